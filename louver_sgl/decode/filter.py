"""Threshold selection and candidate filtering of a decode batch (vectorised torch).

Given exact scores of the dense part and the sample, and the page bounds of every indexed page,
this chooses T per (request, query head), skips pages whose bound is below T, evaluates token
bounds of the surviving pages and returns the candidate mask plus the index part of the dropped
mass (in units of exp(σ·(score − ref))).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import LouverConfig
from ..index.numerics import keep_at_least
from ..index.store import PageBounds, PageIndexStore
from . import threshold as th
from .segments import seg_sum


@dataclass
class FilterResult:
    """Outcome of the index filter.

    threshold ``[B, H_q]`` fp32 (every key scoring >= it is kept); token_threshold ``[B, H_q]``
    (the token gate; −inf when a certified step keeps whole pages); keep_page ``[NP, H_q]`` bool;
    surviving ``[NS]`` int64 rows of the plan's page list; keep ``[NS, P, H_q]`` bool token
    candidates (None when the token pass is left to a fused kernel); pages_skipped ``[B, H_q]``;
    page_mass and dropped ``[B, H_q]`` fp64 bounds on Σ exp(σ·(s − ref)) over skipped pages and
    over all dropped indexed keys.
    """

    threshold: torch.Tensor
    token_threshold: torch.Tensor
    keep_page: torch.Tensor
    surviving: torch.Tensor
    keep: torch.Tensor | None
    pages_skipped: torch.Tensor
    page_mass: torch.Tensor
    dropped: torch.Tensor


def run_filter(
    store: PageIndexStore,
    bounds: PageBounds,
    page_ids: torch.Tensor,
    page_req: torch.Tensor,
    ref: torch.Tensor,
    z_lb: torch.Tensor,
    sample: tuple[torch.Tensor, torch.Tensor],
    sigma: float,
    config: LouverConfig,
    with_tokens: bool = True,
    ops=None,
) -> FilterResult:
    """Choose thresholds and filter.

    Args:
        bounds: page bounds of ``page_ids`` ``[NP]`` (``page_bound`` ``[NP, H_kv, G]``).
        page_req: ``[NP]`` request of each page; ref, z_lb: ``[B, H_q]`` reference score (fp32)
            and exact lower bound of the softmax denominator (fp64, relative to ref).
        sample: (padded sample scores ``[B, M, H_q]`` fp32, sample counts ``[B]``).
        with_tokens: evaluate token bounds here; certified steps always do (T depends on them).
        ops: compiled CPU ops for the grid token bounds (None: torch).
    """
    batch, heads = ref.shape
    size = store.page_size
    pb = bounds.page_bound.reshape(len(page_ids), heads)
    x_page = th.log_mass(pb, ref[page_req], sigma)
    budget = config.eps * z_lb * th.BUDGET_SAFETY
    edge0 = None
    t = th.static_threshold(config, batch, heads)
    if t is None and config.policy == "budget":
        t = th.budget_threshold(sample[0], sample[1], config.budget)
    if t is None:  # certified: first the pages, with half of the budget
        ones = torch.full_like(x_page, float(size))
        edge0 = th.pick_edge(th.mass_below_edges(x_page, ones, page_req, batch), budget / 2)
        t = th.edge_threshold(edge0, ref, sigma)
    keep_page = keep_at_least(pb, t[page_req])
    page_mass = seg_sum(size * torch.exp(x_page.clamp(max=700.0)) * ~keep_page, page_req, batch)
    surviving = keep_page.any(dim=1).nonzero()[:, 0]
    skipped = seg_sum((~keep_page).long(), page_req, batch)
    if not with_tokens and edge0 is None:
        return FilterResult(t, t, keep_page, surviving, None, skipped, page_mass, page_mass)
    sub = PageBounds(bounds.page_bound[surviving], tuple(x[surviving] for x in bounds.terms))
    tok = _token_bounds(store, sub, page_ids[surviving], ops).reshape(len(surviving), size, heads)
    tok = torch.minimum(tok, pb[surviving][:, None, :])
    req_s = page_req[surviving]
    x_tok = th.log_mass(tok, ref[req_s][:, None, :], sigma)
    in_page = keep_page[surviving][:, None, :].expand_as(tok)
    t_tok = t
    if edge0 is not None:
        t_tok = _certified_token_threshold(x_tok, in_page, req_s, edge0, t, budget - page_mass, ref, sigma)
        t = torch.maximum(t_tok, t)  # reported T: every key scoring >= T is kept
    keep = in_page & keep_at_least(tok, t_tok[req_s][:, None, :])
    dropped_tok = torch.exp(x_tok.clamp(max=700.0)) * (in_page & ~keep)
    dropped = page_mass + seg_sum(dropped_tok.sum(1), req_s, batch)
    return FilterResult(t, t_tok, keep_page, surviving, keep, skipped, page_mass, dropped)


def _token_bounds(store: PageIndexStore, bounds: PageBounds, page_ids: torch.Tensor, ops) -> torch.Tensor:
    """Token bounds ``[n, P, H_kv, G]``; the compiled kernel reads packed codes in one pass."""
    if ops is None or store.config.family != "grid":
        return store.token_bounds(bounds, page_ids)
    weights, offset = (t.contiguous() for t in bounds.terms)
    out = torch.empty(len(page_ids), store.page_size, *offset.shape[1:])
    ops.grid_token_bounds(store.tensors["codes"], page_ids.contiguous(), weights, offset,
                          store.config.grid_bits, store.page_size, out)
    return out


def _certified_token_threshold(
    x_tok: torch.Tensor,
    in_page: torch.Tensor,
    req_s: torch.Tensor,
    edge0: torch.Tensor,
    t_page: torch.Tensor,
    remaining: torch.Tensor,
    ref: torch.Tensor,
    sigma: float,
) -> torch.Tensor:
    """Token-level certified threshold (>= the page one) or, if no edge fits, the page one.

    With the page threshold kept, every token of a surviving page is kept, so only the page mass
    is dropped; that always fits because pages used at most half of the budget.
    """
    batch, heads = ref.shape
    n, size, _ = x_tok.shape
    seg = req_s.repeat_interleave(size)
    mass = th.mass_below_edges(
        x_tok.reshape(n * size, heads), in_page.reshape(n * size, heads).double(), seg, batch
    )
    edge = th.pick_edge(mass, remaining, floor=edge0)
    t_tok = th.edge_threshold(edge, ref, sigma)
    # no token edge fits: keep every token of surviving pages (token threshold −inf)
    return torch.where(edge >= 0, torch.maximum(t_tok, t_page), torch.full_like(t_page, float("-inf")))
