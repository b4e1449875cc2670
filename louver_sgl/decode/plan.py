"""Host-side planning of a decode batch: which tokens are dense, which pages are indexed.

Per request with L tokens and P-token pages: full pages 0..L//P−1, the tail (L mod P tokens,
never indexed). The first ``sink_pages`` and last ``recent_pages`` full pages are attended densely
with the tail; the other full pages are read through the index. A fixed, evenly spaced sample of
``sample_size`` indexed tokens is scored exactly (budget quantile, certified lower bound).
Planning may allocate and loop over requests; the device-side step only reads its output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, TypeVar

import torch

from ..config import LouverConfig

_T = TypeVar("_T")


@dataclass
class DecodePlan:
    """Flat index lists of one decode batch (all int64 on the KV device).

    dense_slots/dense_req ``[ND]``; page_ids/page_req ``[NP]``; sample_slots/sample_req ``[NS]``;
    num_indexed ``[B]`` indexed tokens per request; num_pages ``[B]`` indexed pages per request (also
    as the host list ``pages_per_request``); samples_per_request ``[B]``; seq_lens ``[B]``.
    """

    batch_size: int
    page_size: int
    dense_slots: torch.Tensor
    dense_req: torch.Tensor
    page_ids: torch.Tensor
    page_req: torch.Tensor
    sample_slots: torch.Tensor
    sample_req: torch.Tensor
    num_indexed: torch.Tensor
    num_pages: torch.Tensor
    samples_per_request: torch.Tensor
    seq_lens: torch.Tensor
    pages_per_request: tuple[int, ...]
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    def cached(self, key: tuple, make: Callable[[], _T]) -> _T:
        """``make()``, built once per plan and ``key``: host data derived from the plan (kernel task
        lists) and step buffers sized by it. The plan is planned once per forward pass and every
        layer's step reuses these instead of rebuilding them (a step consumes its buffers before it
        returns)."""
        if key not in self.derived:
            self.derived[key] = make()
        return self.derived[key]


def split_pages(num_tokens: int, config: LouverConfig) -> tuple[range, range, range]:
    """(sink pages, indexed pages, recent pages) as page-index ranges of one request."""
    full = num_tokens // config.page_size
    if num_tokens < config.min_sparse_tokens:  # short request: every full page is attended densely
        return range(0, full), range(full, full), range(full, full)
    sink = min(config.sink_pages, full)
    recent = min(config.recent_pages, full - sink)
    return range(0, sink), range(sink, full - recent), range(full - recent, full)


def plan_decode(page_table: torch.Tensor, seq_lens: torch.Tensor, config: LouverConfig) -> DecodePlan:
    """Build the plan.

    Args:
        page_table: ``[B, max_pages]`` int page ids of each request's pages, in order.
        seq_lens: ``[B]`` int tokens per request (including the token being decoded).
    """
    if page_table.dim() != 2 or seq_lens.dim() != 1 or page_table.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"page_table must be [B, max_pages] and seq_lens [B]; got {tuple(page_table.shape)}, "
            f"{tuple(seq_lens.shape)}"
        )
    size = config.page_size
    lens = [int(x) for x in seq_lens.tolist()]
    if min(lens, default=1) < 1 or max(lens, default=0) > page_table.shape[1] * size:
        raise ValueError(f"seq_lens must lie in [1, {page_table.shape[1] * size}], got {lens}")
    table = page_table.long().cpu()
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("ds", "dr", "pi", "pr", "ss", "sr")}
    num_indexed, num_samples = [], []
    for b, n in enumerate(lens):
        sink, indexed, recent = split_pages(n, config)
        dense_pos = torch.cat([
            _page_positions(sink, size), _page_positions(recent, size), torch.arange(n - n % size, n)
        ])
        pages = table[b, indexed.start:indexed.stop]
        parts["ds"].append(_slots(table[b], dense_pos, size))
        parts["pi"].append(pages)
        idx_pos = _sample_positions(len(pages) * size, config.sample_size)
        parts["ss"].append(pages[idx_pos // size] * size + idx_pos % size)
        num_samples.append(len(idx_pos))
        for key, src in (("dr", "ds"), ("pr", "pi"), ("sr", "ss")):
            parts[key].append(torch.full((len(parts[src][-1]),), b, dtype=torch.long))
        num_indexed.append(len(pages) * size)
    dev = page_table.device
    cat = {k: torch.cat(v).to(dev) if v else torch.zeros(0, dtype=torch.long, device=dev) for k, v in parts.items()}
    pages_per_request = tuple(n // size for n in num_indexed)
    return DecodePlan(
        batch_size=len(lens), page_size=size,
        dense_slots=cat["ds"], dense_req=cat["dr"], page_ids=cat["pi"], page_req=cat["pr"],
        sample_slots=cat["ss"], sample_req=cat["sr"],
        num_indexed=torch.tensor(num_indexed, dtype=torch.long, device=dev),
        num_pages=torch.tensor(pages_per_request, dtype=torch.long, device=dev),
        samples_per_request=torch.tensor(num_samples, dtype=torch.long, device=dev),
        seq_lens=torch.tensor(lens, dtype=torch.long, device=dev),
        pages_per_request=pages_per_request,
    )


def _page_positions(pages: range, size: int) -> torch.Tensor:
    return torch.arange(pages.start * size, pages.stop * size)


def _slots(row: torch.Tensor, positions: torch.Tensor, size: int) -> torch.Tensor:
    return row[positions // size] * size + positions % size


def _sample_positions(num_tokens: int, sample_size: int) -> torch.Tensor:
    """Evenly spaced positions in [0, num_tokens): all of them when there are few."""
    if num_tokens <= sample_size:
        return torch.arange(num_tokens)
    return torch.arange(sample_size) * num_tokens // sample_size
