"""Page-local index tensors, indexed by page id and slot id beside a paged KV pool.

A page's index is a deterministic function of its keys, so pages shared through a prefix cache
are read as they are. ``PageIndexStore`` owns the tensors (sized from the pool once), builds many
pages in one batched call, and evaluates page and token bounds for a batch of (page, query) rows.
Slot ``s`` belongs to page ``s // page_size``; a page's slots are contiguous, as in SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import LouverConfig
from ..memory import huge_zeros
from . import clustered, grid


@dataclass
class PageBounds:
    """Query-side state of a batch of pages: page bounds plus what token bounds need.

    ``page_bound`` is ``[n, H_kv, G]`` fp32 (slack included); ``terms`` holds family-specific
    tensors for ``PageIndexStore.token_bounds``.
    """

    page_bound: torch.Tensor
    terms: tuple[torch.Tensor, ...]


class PageIndexStore:
    """Index tensors for ``num_pages`` pages of ``page_size`` slots.

    Grid family: ``lo``, ``scale``, ``radius`` ``[num_pages, H_kv, D]`` (KV dtype) and ``codes``
    ``[num_slots, H_kv, D * bits // 8]`` uint8. Clustered family: ``centers``
    ``[num_pages, H_kv, S, C, w]``, ``radius`` ``[num_pages, H_kv, S, C]`` fp32, ``codes``
    ``[num_slots, H_kv, S]`` uint8 and optionally ``residual`` ``[num_slots, H_kv, S]``.
    """

    def __init__(
        self,
        config: LouverConfig,
        num_pages: int,
        num_kv_heads: int,
        head_dim: int,
        kv_dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if kv_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"unsupported KV dtype {kv_dtype}; use float32, float16 or bfloat16")
        config.subspace_width(head_dim)
        self.config = config
        self.num_pages, self.num_kv_heads, self.head_dim = num_pages, num_kv_heads, head_dim
        self.kv_dtype = kv_dtype
        self.on_cpu = torch.device(device).type == "cpu"
        self.tensors = _allocate(config, num_pages, num_kv_heads, head_dim, kv_dtype, device)
        # compiled decode steps of the layers this index serves (louver_decode's fast path; keyed
        # by the step's KV caches, config, scale, backend and split; each entry keeps its caches)
        self.compiled_steps: dict = {}

    @property
    def page_size(self) -> int:
        return self.config.page_size

    def nbytes(self) -> int:
        """Bytes held by the index tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def bytes_per_token_head(self) -> float:
        """Index bytes per token slot per KV head (codes plus amortised page codebooks)."""
        return self.nbytes() / (self.num_pages * self.page_size * self.num_kv_heads)

    def build_pages(self, k_cache: torch.Tensor, page_ids: torch.Tensor) -> None:
        """Build the index of every page in ``page_ids`` from its stored keys (on CUDA, the grid
        family is built by one Triton launch).

        Args:
            k_cache: ``[num_slots, H_kv, D]`` key buffer (slot = page_id * P + offset).
            page_ids: ``[n]`` int64 ids of full pages.
        """
        if page_ids.numel() == 0:
            return
        if self.config.family == "grid" and k_cache.is_cuda:
            from louver_kernels.triton.grid_build import grid_build

            t = self.tensors
            grid_build(k_cache, page_ids, t["lo"], t["scale"], t["radius"], t["codes"], self.page_size,
                       self.config.grid_bits)
            return
        size = self.page_size
        slots = (page_ids.long()[:, None] * size + torch.arange(size, device=page_ids.device))
        keys = k_cache[slots.reshape(-1)].reshape(-1, size, self.num_kv_heads, self.head_dim)
        built = self._build(keys)
        for name, value in built.items():
            dest = self.tensors[name]
            if name in ("codes", "residual"):
                dest.view(self.num_pages, size, *dest.shape[1:])[page_ids] = value
            else:
                dest[page_ids] = value

    def _build(self, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        cfg = self.config
        if cfg.family == "grid":
            return grid.build_grid(keys, cfg.grid_bits, self.kv_dtype)
        return clustered.build_clustered(
            keys, cfg.n_subspaces, cfg.cluster_size, self.kv_dtype, cfg.residual_norms
        )

    def page_bounds(self, q: torch.Tensor, page_ids: torch.Tensor) -> PageBounds:
        """Bounds of pages ``page_ids`` ``[n]`` for query rows ``q`` ``[n, H_kv, G, D]`` fp32."""
        t = self.tensors
        if self.config.family == "grid":
            w, offset, pb = grid.grid_query_terms(
                q, t["lo"][page_ids], t["scale"][page_ids], t["radius"][page_ids],
                self.config.grid_bits,
            )
            return PageBounds(pb, (w, offset))
        radius = t["radius"][page_ids]
        dots, q_norm, pb, slack = clustered.clustered_cluster_scores(q, t["centers"][page_ids], radius)
        return PageBounds(pb, (dots, q_norm, radius, slack))

    def token_bounds(self, bounds: PageBounds, page_ids: torch.Tensor) -> torch.Tensor:
        """Token upper bounds ``[n, P, H_kv, G]`` fp32 for the pages of ``bounds``."""
        codes = self._page_rows("codes", page_ids)
        if self.config.family == "grid":
            w, offset = bounds.terms
            return grid.grid_token_bounds(codes, w, offset, self.config.grid_bits)
        dots, q_norm, radius, slack = bounds.terms
        residual = self._page_rows("residual", page_ids) if self.config.residual_norms else None
        return clustered.clustered_token_bounds(codes, dots, q_norm, radius, slack, residual)

    def _page_rows(self, name: str, page_ids: torch.Tensor) -> torch.Tensor:
        dest = self.tensors[name]
        return dest.view(self.num_pages, self.page_size, *dest.shape[1:])[page_ids]


def _allocate(
    cfg: LouverConfig, pages: int, heads: int, dim: int, dtype: torch.dtype, device
) -> dict[str, torch.Tensor]:
    # huge_zeros: on CPU a step reads a page's codes at a random place in these buffers (TLB misses)
    slots = pages * cfg.page_size
    if cfg.family == "grid":
        per_page = (pages, heads, dim)
        return {
            "lo": huge_zeros(per_page, dtype, device),
            "scale": huge_zeros(per_page, dtype, device),
            "radius": huge_zeros(per_page, dtype, device),
            "codes": huge_zeros((slots, heads, dim * cfg.grid_bits // 8), torch.uint8, device),
        }
    n_sub, clusters = cfg.n_subspaces, cfg.page_size // cfg.cluster_size
    width = dim // n_sub
    out = {
        "centers": huge_zeros((pages, heads, n_sub, clusters, width), dtype, device),
        "radius": huge_zeros((pages, heads, n_sub, clusters), torch.float32, device),
        "codes": huge_zeros((slots, heads, n_sub), torch.uint8, device),
    }
    if cfg.residual_norms:
        out["residual"] = huge_zeros((slots, heads, n_sub), dtype, device)
    return out
