"""Host-side planning of a decode batch: which tokens are dense, which pages are indexed.

The request layout (sink, indexed and recent pages, the tail) is ``contract.RequestLayout``. A
fixed, evenly spaced sample of ``sample_size`` indexed tokens is scored exactly (budget quantile,
certified lower bound).
Planning may allocate and loop over requests; the device-side step only reads its output.
"""

from __future__ import annotations

import torch

from ..config import LouverConfig
from .contract import DecodePlan, RequestLayout


def split_pages(num_tokens: int, config: LouverConfig) -> tuple[range, range, range]:
    """(sink pages, indexed pages, recent pages) as page-index ranges of one request
    (``contract.RequestLayout.split``)."""
    return RequestLayout.of(config).split(num_tokens)


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
    layout = RequestLayout.of(config)
    lens = [int(x) for x in seq_lens.tolist()]
    if min(lens, default=1) < 1 or max(lens, default=0) > page_table.shape[1] * size:
        raise ValueError(f"seq_lens must lie in [1, {page_table.shape[1] * size}], got {lens}")
    table = page_table.long().cpu()
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("ds", "dr", "pi", "pr", "ss", "sr")}
    num_indexed, num_samples = [], []
    for b, n in enumerate(lens):
        sink, indexed, recent = layout.split(n)
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
        pages_per_request=pages_per_request, page_table=page_table,
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
