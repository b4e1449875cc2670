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
    uint8 in one of two layouts (``code_layout``): "token", ``[num_slots, H_kv, D * bits // 8]``,
    or "block16", ``[num_slots // 16, H_kv, D * bits // 32, 16, 4]``: per 16 slots and KV head,
    dword j of the 16 tokens side by side, which is the compiled CPU scan's operand as stored
    (transposing 16 token rows in registers was the largest part of its work). ``code_layout=None``
    picks block16 for grid stores on CPU whose pages are a multiple of 16 slots and whose codes are
    whole dwords, else token (the Triton kernels read token rows). ``page_codes`` returns
    token-major codes in either layout. Clustered family: ``centers``
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
        code_layout: str | None = None,
    ) -> None:
        if kv_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"unsupported KV dtype {kv_dtype}; use float32, float16 or bfloat16")
        config.subspace_width(head_dim)
        self.config = config
        self.num_pages, self.num_kv_heads, self.head_dim = num_pages, num_kv_heads, head_dim
        self.kv_dtype = kv_dtype
        self.on_cpu = torch.device(device).type == "cpu"
        self.code_bytes = _code_bytes(config, head_dim)
        self.code_layout = _code_layout(config, self.code_bytes, self.on_cpu, code_layout)
        self.tensors = _allocate(config, num_pages, num_kv_heads, head_dim, kv_dtype, device, self.code_layout)

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
        if self.config.grid_codes and k_cache.is_cuda:
            from louver_kernels.triton.grid_build import grid_build

            if self.code_layout != "token":
                raise ValueError("the Triton page build writes token-layout codes; make the store with "
                                 "code_layout='token'")

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
            if name == "codes" and self.code_layout == "block16":
                dest.view(self.num_pages, size // 16, *dest.shape[1:])[page_ids] = _to_block16(value)
            elif name in ("codes", "residual"):
                dest.view(self.num_pages, size, *dest.shape[1:])[page_ids] = value
            else:
                dest[page_ids] = value

    def _build(self, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        cfg = self.config
        if cfg.grid_codes:
            return grid.build_grid(keys, cfg.grid_bits, self.kv_dtype)
        return clustered.build_clustered(
            keys, cfg.n_subspaces, cfg.cluster_size, self.kv_dtype, cfg.residual_norms
        )

    def page_bounds(self, q: torch.Tensor, page_ids: torch.Tensor) -> PageBounds:
        """Bounds of pages ``page_ids`` ``[n]`` for query rows ``q`` ``[n, H_kv, G, D]`` fp32."""
        t = self.tensors
        if self.config.grid_codes:
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
        codes = self.page_codes(page_ids)
        if self.config.grid_codes:
            w, offset = bounds.terms
            return grid.grid_token_bounds(codes, w, offset, self.config.grid_bits)
        dots, q_norm, radius, slack = bounds.terms
        residual = self._page_rows("residual", page_ids) if self.config.residual_norms else None
        return clustered.clustered_token_bounds(codes, dots, q_norm, radius, slack, residual)

    def page_codes(self, page_ids: torch.Tensor) -> torch.Tensor:
        """Codes of pages ``page_ids`` ``[n]`` token-major, ``[n, P, H_kv, bytes]`` uint8, in
        either layout."""
        if self.code_layout == "block16":
            dest = self.tensors["codes"]
            return _from_block16(dest.view(self.num_pages, self.page_size // 16, *dest.shape[1:])[page_ids])
        return self._page_rows("codes", page_ids)

    def code_bytes_per_page(self) -> int:
        """Bytes of one page's codes (all KV heads)."""
        return self.page_size * self.num_kv_heads * self.code_bytes

    def _page_rows(self, name: str, page_ids: torch.Tensor) -> torch.Tensor:
        dest = self.tensors[name]
        return dest.view(self.num_pages, self.page_size, *dest.shape[1:])[page_ids]


CODE_LAYOUTS = ("token", "block16")


def _code_bytes(cfg: LouverConfig, dim: int) -> int:
    """Bytes of codes per token and KV head."""
    return dim * cfg.grid_bits // 8 if cfg.grid_codes else cfg.n_subspaces


def _code_layout(cfg: LouverConfig, code_bytes: int, on_cpu: bool, asked: str | None) -> str:
    """The codes' layout: ``asked``, checked, or the default (see ``PageIndexStore``)."""
    fits = cfg.grid_codes and cfg.page_size % 16 == 0 and code_bytes % 4 == 0
    if asked is None:
        return "block16" if fits and on_cpu else "token"
    if asked not in CODE_LAYOUTS:
        raise ValueError(f"code_layout must be one of {CODE_LAYOUTS} or None, got {asked!r}")
    if asked == "block16" and not fits:
        raise ValueError("code_layout 'block16' needs the grid family, a page size that is a multiple of 16 and "
                         f"codes of whole dwords per token (got {code_bytes} bytes)")
    return asked


def _to_block16(codes: torch.Tensor) -> torch.Tensor:
    """Token-major page codes ``[n, P, H_kv, bytes]`` -> ``[n, P // 16, H_kv, bytes // 4, 16, 4]``."""
    n, size, heads, nbytes = codes.shape
    return codes.view(n, size // 16, 16, heads, nbytes // 4, 4).permute(0, 1, 3, 4, 2, 5)


def _from_block16(blocks: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_to_block16``: ``[n, P // 16, H_kv, bytes // 4, 16, 4]`` -> ``[n, P, H_kv, bytes]``."""
    n, nblk, heads, words = blocks.shape[:4]
    return blocks.permute(0, 1, 4, 2, 3, 5).reshape(n, nblk * 16, heads, words * 4)


def _allocate(
    cfg: LouverConfig, pages: int, heads: int, dim: int, dtype: torch.dtype, device, code_layout: str = "token"
) -> dict[str, torch.Tensor]:
    # huge_zeros: on CPU a step reads a page's codes at a random place in these buffers (TLB misses)
    slots = pages * cfg.page_size
    if cfg.grid_codes:
        per_page = (pages, heads, dim)
        nbytes = dim * cfg.grid_bits // 8
        shape = (slots // 16, heads, nbytes // 4, 16, 4) if code_layout == "block16" else (slots, heads, nbytes)
        return {
            "lo": huge_zeros(per_page, dtype, device),
            "scale": huge_zeros(per_page, dtype, device),
            "radius": huge_zeros(per_page, dtype, device),
            "codes": huge_zeros(shape, torch.uint8, device),
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
