"""``LouverIndex``: the standalone range-search API, usable without SGLang.

In the spirit of faiss's range search: build once over a key sequence, then ask for every key whose
exact dot product with a query reaches a threshold. The result is a superset (zero false
negatives, also in floating point); keys of the trailing partial page are always returned because
they are not indexed.
"""

from __future__ import annotations

import torch

from ..config import LouverConfig
from .numerics import keep_at_least
from .store import PageIndexStore

_KEY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class LouverIndex:
    """Page-local Louver index over keys ``[N, H_kv, D]`` (token-major, as in a KV cache)."""

    def __init__(self, store: PageIndexStore, num_tokens: int) -> None:
        self.store = store
        self.num_tokens = num_tokens

    @classmethod
    def build(cls, keys: torch.Tensor, config: LouverConfig | None = None) -> "LouverIndex":
        """Index every full page of ``keys`` ``[N, H_kv, D]`` (fp32/fp16/bf16)."""
        config = config or LouverConfig()
        if not isinstance(keys, torch.Tensor) or keys.dim() != 3:
            raise ValueError(f"keys must be a tensor [N, H_kv, D], got shape {getattr(keys, 'shape', None)}")
        if keys.dtype not in _KEY_DTYPES:
            raise ValueError(f"keys dtype must be one of {_KEY_DTYPES}, got {keys.dtype}")
        n, heads, dim = keys.shape
        num_pages = n // config.page_size
        store = PageIndexStore(config, num_pages, heads, dim, keys.dtype, keys.device)
        store.build_pages(keys.contiguous(), torch.arange(num_pages, device=keys.device))
        return cls(store, n)

    @property
    def config(self) -> LouverConfig:
        return self.store.config

    @property
    def num_indexed(self) -> int:
        return self.store.num_pages * self.store.page_size

    def upper_bounds(self, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token and page upper bounds of every indexed key.

        Args:
            queries: ``[H_q, D]`` (H_q a multiple of H_kv; head h uses KV head h // (H_q // H_kv)).

        Returns ``(token_bound [H_q, N_indexed], page_bound [H_q, num_pages])`` fp32.
        """
        q = self._check_queries(queries)
        store = self.store
        pages = torch.arange(store.num_pages, device=q.device)
        rows = q.reshape(1, store.num_kv_heads, -1, store.head_dim).expand(len(pages), -1, -1, -1)
        bounds = store.page_bounds(rows.contiguous(), pages)
        tokens = store.token_bounds(bounds, pages)  # [n, P, H_kv, G]
        h_q = q.shape[0]
        token_bound = tokens.reshape(-1, h_q).t()
        page_bound = bounds.page_bound.reshape(-1, h_q).t()
        return token_bound, page_bound

    def range_search(self, queries: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
        """Candidates for ``{i : q_h·k_i >= T_h}``.

        Args:
            queries: ``[H_q, D]`` float queries.
            thresholds: ``[H_q]`` thresholds in raw dot-product units (−inf keeps everything).

        Returns a bool mask ``[H_q, N]``, True for every key whose exact score reaches the
        threshold (and possibly others); ties keep.
        """
        q = self._check_queries(queries)
        t = self._check_thresholds(thresholds, q.shape[0])
        mask = torch.ones((q.shape[0], self.num_tokens), dtype=torch.bool, device=q.device)
        if self.num_indexed:
            token_bound, page_bound = self.upper_bounds(q)
            keep_page = keep_at_least(page_bound, t[:, None])
            keep_tok = keep_at_least(token_bound, t[:, None])
            keep_tok &= keep_page.repeat_interleave(self.store.page_size, dim=1)
            mask[:, : self.num_indexed] = keep_tok
        return mask

    def _check_queries(self, queries: torch.Tensor) -> torch.Tensor:
        store = self.store
        if not isinstance(queries, torch.Tensor) or queries.dim() != 2:
            raise ValueError(f"queries must be a tensor [H_q, D], got shape {getattr(queries, 'shape', None)}")
        if queries.dtype not in _KEY_DTYPES:
            raise ValueError(f"queries dtype must be one of {_KEY_DTYPES}, got {queries.dtype}")
        h_q, dim = queries.shape
        if dim != store.head_dim:
            raise ValueError(f"queries head dim {dim} != keys head dim {store.head_dim}")
        if h_q % store.num_kv_heads:
            raise ValueError(f"H_q ({h_q}) must be a multiple of H_kv ({store.num_kv_heads})")
        return queries.to(torch.float32)

    @staticmethod
    def _check_thresholds(thresholds: torch.Tensor, h_q: int) -> torch.Tensor:
        t = torch.as_tensor(thresholds)
        if t.shape != (h_q,):
            raise ValueError(f"thresholds must have shape [{h_q}], got {tuple(t.shape)}")
        if torch.isnan(t).any():
            raise ValueError("thresholds must not be NaN")
        return t.to(torch.float32)
