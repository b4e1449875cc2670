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
    over all dropped indexed keys; lowered ``[B, H_q]`` bool: heads whose first level failed its
    check (``StepStats.lowered``; None where the rule has no check).
    """

    threshold: torch.Tensor
    token_threshold: torch.Tensor
    keep_page: torch.Tensor
    surviving: torch.Tensor
    keep: torch.Tensor | None
    pages_skipped: torch.Tensor
    page_mass: torch.Tensor
    dropped: torch.Tensor
    lowered: torch.Tensor | None = None


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
) -> FilterResult:
    """Choose thresholds and filter.

    Args:
        bounds: page bounds of ``page_ids`` ``[NP]`` (``page_bound`` ``[NP, H_kv, G]``).
        page_req: ``[NP]`` request of each page; ref, z_lb: ``[B, H_q]`` reference score (fp32)
            and exact lower bound of the softmax denominator (fp64, relative to ref).
        sample: (padded sample scores ``[B, M, H_q]`` fp32, sample counts ``[B]``).
        with_tokens: evaluate token bounds here (certified steps always do: T depends on them).
    """
    batch, heads = ref.shape
    size = store.page_size
    pb = bounds.page_bound.reshape(len(page_ids), heads)
    x_page = th.log_mass(pb, ref[page_req], sigma)
    t = th.static_threshold(config, batch, heads)
    if t is None and config.threshold.budget_rule:
        t = th.budget_threshold(sample[0], sample[1], config.budget)
    if t is None:  # certified: T depends on every token bound
        tok = store.token_bounds(bounds, page_ids).reshape(len(page_ids), size, heads)
        if config.threshold.one_pass:
            return one_pass_filter(pb, tok, page_req, ref, z_lb, sigma, config)
        return certified_filter(pb, tok, page_req, ref, z_lb, sigma, config)
    keep_page = keep_at_least(pb, t[page_req])
    surviving = keep_page.any(dim=1).nonzero()[:, 0]
    if not with_tokens:
        page_mass = _page_mass(x_page, keep_page, page_req, batch, size)
        skipped = seg_sum((~keep_page).long(), page_req, batch)
        return FilterResult(t, t, keep_page, surviving, None, skipped, page_mass, page_mass)
    sub = PageBounds(bounds.page_bound[surviving], tuple(x[surviving] for x in bounds.terms))
    tok = store.token_bounds(sub, page_ids[surviving]).reshape(len(surviving), size, heads)
    tok = torch.minimum(tok, pb[surviving][:, None, :])
    x_tok = th.log_mass(tok, ref[page_req[surviving]][:, None, :], sigma)
    return _apply(t, pb, x_page, tok, x_tok, page_req, surviving, None)


def certified_filter(pb, tok, page_req, ref, z_lb, sigma: float, config: LouverConfig) -> FilterResult:
    """Certified T and filter from page bounds ``[NP, H_q]`` and token bounds ``[NP, P, H_q]``.

    T and the certificate come from ``threshold.certified_choice`` (the rule every implementation
    follows); the certificate is the index-dropped mass (no recount)."""
    t, certificate, _, _ = th.certified_choice(pb, tok, page_req, ref, z_lb, sigma, config.eps * th.BUDGET_SAFETY,
                                               th.HIST_ROUNDING)
    return _refilter(t, pb, tok, page_req, ref, sigma, certificate)


@dataclass
class FirstLevel:
    """What the a-posteriori rule's second level needs from the first: the bounds (page ``[NP,
    H_q]``, clamped token ``[NP, P, H_q]`` and their log-masses), the certified bound at every
    edge ``[B, H_q, E]`` fp64 and the first edge ``[B, H_q]`` int64."""

    pb: torch.Tensor
    tok: torch.Tensor
    x_page: torch.Tensor
    x_tok: torch.Tensor
    page_req: torch.Tensor
    bound: torch.Tensor
    edge: torch.Tensor


def a_posteriori_filter(pb, tok, page_req, ref, z_est, sigma: float, config: LouverConfig):
    """The a-posteriori rule's first level (``threshold.a_posteriori_first``) and its filter:
    (FilterResult at T0 with the bound at T0 as its dropped mass, FirstLevel)."""
    eps_budget = config.eps * th.BUDGET_SAFETY
    _, _, hist, habs = th.certified_choice(pb, tok, page_req, ref, ref.new_zeros(ref.shape, dtype=torch.float64),
                                           sigma, eps_budget, th.HIST_ROUNDING)
    bound = th.histogram_bound(hist, habs, th.HIST_ROUNDING)
    edge, t0 = th.a_posteriori_first(bound, ref, z_est, sigma, eps_budget)
    tok = torch.minimum(tok, pb[:, None, :])
    x_page = th.log_mass(pb, ref[page_req], sigma)
    x_tok = th.log_mass(tok, ref[page_req][:, None, :], sigma)
    cert = torch.where(edge < 0, 0.0, bound.gather(-1, edge.clamp(min=0)[..., None])[..., 0])
    first = FirstLevel(pb, tok, x_page, x_tok, page_req, bound, edge)
    return _apply(t0, pb, x_page, tok, x_tok, page_req, torch.arange(len(pb)), cert), first


def a_posteriori_second(first: FirstLevel, ref, z_att, sigma: float, config: LouverConfig) -> FilterResult:
    """The check against Z_att ``[B, H_q]`` fp64 and the final level
    (``threshold.a_posteriori_second``): FilterResult at the final T, with its certificate as the
    dropped mass and the heads whose level was lowered (the band) as ``lowered``."""
    _, t, cert, band = th.a_posteriori_second(first.bound, first.edge, ref, z_att, sigma,
                                              config.eps * th.BUDGET_SAFETY)
    filt = _apply(t, first.pb, first.x_page, first.tok, first.x_tok, first.page_req, torch.arange(len(first.pb)),
                  cert)
    filt.lowered = band
    return filt


def one_pass_filter(pb, tok, page_req, ref, z_lb, sigma: float, config: LouverConfig) -> FilterResult:
    """The one-pass certified rule (``threshold.safe_level`` / ``provisional_certified``): gate at
    the provisional level and certify the mass that gate drops; requests with a head whose check
    fails take the histogram rule (``certified_filter``) instead. The token bounds of every page
    are an input here because the failing requests need them; the compiled step computes them
    a second time only for those."""
    eps_budget = config.eps * th.BUDGET_SAFETY
    provisional = provisional_filter(pb, tok, page_req, ref, z_lb, sigma, config)
    ok, certificate = th.provisional_certified(provisional.dropped, z_lb, eps_budget, th.HIST_ROUNDING)
    failed = ~ok.all(dim=1)
    if not bool(failed.any()):
        provisional.dropped, provisional.lowered = certificate, ~ok
        return provisional
    t_c, cert_c, _, _ = th.certified_choice(pb, tok, page_req, ref, z_lb, sigma, eps_budget, th.HIST_ROUNDING)
    t = torch.where(failed[:, None], t_c, provisional.threshold)
    filt = _refilter(t, pb, tok, page_req, ref, sigma, torch.where(failed[:, None], cert_c, certificate))
    filt.lowered = ~ok
    return filt


def provisional_filter(pb, tok, page_req, ref, z_level, sigma: float, config: LouverConfig) -> FilterResult:
    """The one-pass rule's gate: T_p = the safe level at ``z_level`` ``[B, H_q]`` fp64 (Z_lb, or
    the a-posteriori estimate Z_est), with the gate's own dropped-mass bound as ``dropped``."""
    batch, size = ref.shape[0], tok.shape[1]
    num_indexed = seg_sum(torch.ones_like(page_req), page_req, batch) * size
    t_p = th.safe_level(ref, z_level, num_indexed, sigma, config.eps * th.BUDGET_SAFETY, th.HIST_ROUNDING)
    return _refilter(t_p, pb, tok, page_req, ref, sigma)


def one_pass_a_posteriori_check(provisional: FilterResult, pb, tok, page_req, ref, z_att, sigma: float,
                                config: LouverConfig) -> FilterResult:
    """The check of the one-pass rule a posteriori against Z_att ``[B, H_q]`` fp64
    (``threshold.lowered_to_safe``): FilterResult at the final T with the certificates as its
    dropped mass and the lowered heads as ``lowered``."""
    batch, size = ref.shape[0], tok.shape[1]
    num_indexed = seg_sum(torch.ones_like(page_req), page_req, batch) * size
    t, certificate, lowered = th.lowered_to_safe(provisional.threshold, provisional.dropped, z_att, ref, num_indexed,
                                                 sigma, config.eps * th.BUDGET_SAFETY, th.HIST_ROUNDING)
    if not bool(lowered.any()):
        provisional.dropped, provisional.lowered = certificate, lowered
        return provisional
    filt = _refilter(t, pb, tok, page_req, ref, sigma, certificate)
    filt.lowered = lowered
    return filt


def _refilter(t, pb, tok, page_req, ref, sigma: float, certificate=None) -> FilterResult:
    """Every page row filtered at T ``[B, H_q]`` from page bounds ``[NP, H_q]`` and token bounds
    ``[NP, P, H_q]`` (clamped here to their page's), with ``certificate`` as the dropped mass (or
    the exact dropped bound)."""
    tok_p = torch.minimum(tok, pb[:, None, :])
    x_page = th.log_mass(pb, ref[page_req], sigma)
    x_tok = th.log_mass(tok_p, ref[page_req][:, None, :], sigma)
    return _apply(t, pb, x_page, tok_p, x_tok, page_req, torch.arange(len(pb)), certificate)


def _apply(t, pb, x_page, tok, x_tok, page_req, rows, certificate=None) -> FilterResult:
    """Keep pages and tokens whose bound reaches T and account the dropped mass: exactly, or as
    the certified rule's ``certificate`` ``[B, H_q]`` (which bounds it).

    ``tok``/``x_tok`` cover the plan's page rows ``rows``.
    """
    batch, size = t.shape[0], tok.shape[1]
    keep_page = keep_at_least(pb, t[page_req])
    in_page = keep_page[rows][:, None, :].expand_as(tok)
    keep = in_page & keep_at_least(tok, t[page_req[rows]][:, None, :])
    page_mass = _page_mass(x_page, keep_page, page_req, batch, size)
    if certificate is None:
        dropped_tok = torch.exp(x_tok.clamp(max=700.0)).nan_to_num(nan=0.0) * (in_page & ~keep)
        dropped = page_mass + seg_sum(dropped_tok.sum(1), page_req[rows], batch)
    else:
        dropped = certificate
    skipped = seg_sum((~keep_page).long(), page_req, batch)
    surviving = rows[keep_page[rows].any(dim=1)]
    keep = keep[keep_page[rows].any(dim=1)]
    return FilterResult(t, t, keep_page, surviving, keep, skipped, page_mass, dropped)


def _page_mass(x_page, keep_page, page_req, batch, size) -> torch.Tensor:
    mass = size * torch.exp(x_page.clamp(max=700.0)).nan_to_num(nan=0.0) * ~keep_page
    return seg_sum(mass, page_req, batch)
