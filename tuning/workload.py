"""Decode batches the tuner times and validates: captured traces paged at a trial's page size,
with page indexes cached per index layout (a trial that changes only dispatch or launch knobs
reuses the index built for an earlier trial)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from louver_sgl import LouverConfig, PageIndexStore
from louver_eval.data.paged import PagedBatch, paged_batch
from louver_sgl.decode.plan import plan_decode

from .target import Target

LAYOUT_FIELDS = ("page_size", "family", "grid_bits", "n_subspaces", "cluster_size", "clustering", "residual_norms")


@dataclass(frozen=True)
class Case:
    """One (context length, batch size, layer) of a trace; ``trace`` is the loaded trace dict."""

    name: str
    trace: Any
    batch: int
    layer: int

    @property
    def length(self) -> int:
        return int(self.trace["meta"]["length"])


def parse_case(spec: str) -> tuple[int, int]:
    """``"8192x8"`` -> (8192, 8): context tokens and batch size."""
    try:
        length, batch = (int(x) for x in spec.lower().split("x"))
    except ValueError as exc:
        raise ValueError(f"case must look like LENGTHxBATCH (e.g. 8192x8), got {spec!r}") from exc
    if length < 1 or batch < 1:
        raise ValueError(f"case {spec!r}: length and batch must be positive")
    return length, batch


class Workload:
    """Paged batches and built indexes on the target's device, cached (LRU) across trials."""

    def __init__(self, target: Target, kv_dtype: torch.dtype, max_cached: int = 12) -> None:
        self.target, self.kv_dtype, self.max_cached = target, kv_dtype, max_cached
        self._batches: OrderedDict[tuple, PagedBatch] = OrderedDict()
        self._stores: OrderedDict[tuple, PageIndexStore] = OrderedDict()

    def get(self, case: Case, config: LouverConfig) -> tuple[PagedBatch, PageIndexStore]:
        """The batch of ``case`` paged at ``config.page_size`` and its index in ``config``'s layout."""
        bkey = (case.name, config.page_size)
        batch = self._cached(self._batches, bkey, lambda: self.target.place(
            paged_batch(case.trace, case.layer, case.batch, config.page_size, self.kv_dtype, huge_pages=True)))
        skey = bkey + tuple(getattr(config, f) for f in LAYOUT_FIELDS)
        store = self._cached(self._stores, skey, lambda: self._build(batch, config))
        return batch, store

    def _build(self, batch: PagedBatch, config: LouverConfig) -> PageIndexStore:
        """Index every indexed page of ``batch`` (all pages: dispatch knobs vary across trials)."""
        base = config.with_(sink_pages=0, recent_pages=0, min_sparse_tokens=0)
        store = PageIndexStore(base, len(batch.k) // config.page_size, batch.k.shape[1], batch.k.shape[2],
                               batch.k.dtype, batch.k.device, code_layout=self.target.code_layout)
        store.build_pages(batch.k, plan_decode(batch.page_table, batch.seq_lens, base).page_ids)
        return store

    def _cached(self, cache: OrderedDict, key: tuple, make):
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
        while len(cache) >= self.max_cached:
            cache.popitem(last=False)
        cache[key] = value = make()
        return value
