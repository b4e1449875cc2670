"""Turn captured SmolLM2 traces into paged decode batches for benchmarks and tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from louver_sgl.memory import huge_zeros
from .capture import load_trace

__all__ = ["PagedBatch", "load_trace", "paged_batch"]


@dataclass
class PagedBatch:
    """A decode batch over one trace layer: q ``[B, H_q, D]`` fp32, k/v ``[B * pages * P, H_kv, D]``,
    page_table ``[B, pages]``, seq_lens ``[B]``, softmax scale ``sigma``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    sigma: float


def paged_batch(trace: dict, layer: int, batch: int, page_size: int, dtype=torch.float16,
                huge_pages: bool = False) -> PagedBatch:
    """Request b decodes the trace's b-th captured query over its own copy of the keys it sees.

    Each request gets its own pages (as separate requests would in a KV pool); the page order is
    shuffled so that nothing relies on contiguity. ``huge_pages``: the K/V pool lies on
    transparent huge pages, as the louver server's pool does (``louver_sgl.memory``).
    """
    keys, values = trace["keys"][layer], trace["values"][layer]
    queries, positions = trace["queries"][layer], trace["query_positions"]
    lens = [int(positions[b % len(positions)]) + 1 for b in range(batch)]
    pages_per = (max(lens) + page_size - 1) // page_size
    total = pages_per * batch
    shape = (total * page_size, *keys.shape[1:])
    zeros = huge_zeros if huge_pages else (lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    k, v = zeros(shape, dtype), zeros(shape, dtype)
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(0)).view(batch, pages_per)
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        slots = perm[b, pos // page_size] * page_size + pos % page_size
        k[slots], v[slots] = keys[:n].to(dtype), values[:n].to(dtype)
    q = torch.stack([queries[b % len(positions)] for b in range(batch)]).float()
    return PagedBatch(q, k, v, perm, torch.tensor(lens), float(trace["meta"]["softmax_scale"]))
