"""Threshold policies and the certified dropped-mass accounting.

All mass arithmetic is in fp64 relative to a reference score ``m`` (the largest exact score known
this step), i.e. a unit with upper bound u and weight w has mass w·exp(σ·(u − m)).

Certified rule (design §4): with Z_lb = Σ exp(σ·(s − m)) over scores computed exactly this step,
choose T so that Σ over every dropped unit of w·exp(σ·(u − m)) ≤ ε·Z_lb, where the units are the
pages whose bound is below T (weight P) and the tokens below T in the other pages. Since every
dropped key has exact score ≤ u and Z_lb ≤ the true softmax denominator, the dropped softmax mass
is < ε. The candidate levels are the fixed edges ``contract.EDGES`` (in units of σ·(T − m)), so the choice
is one histogram pass plus a cumulative sum (``certified_choice``); the certificate is the
histogram's sum at the chosen edge plus a bound on its fp64 rounding, with no recount.

One-pass rule (``certified_passes=1``, design notes "Certified in one pass"): gate at the
provisional level ``safe_level`` and certify the gate's own dropped-mass bound
(``provisional_certified``); requests with a head whose check fails take the histogram rule.
"""

from __future__ import annotations

import math

import torch

from ..config import LouverConfig
from .contract import BUDGET_SAFETY, EDGES, HIST_ROUNDING, VALUE_GATE, ThresholdEdges  # noqa: F401 (re-exported)

# The edges of the certified rule (contract.EDGES is their one definition; these names read them).
EDGE_LOW, EDGE_STEP, EDGE_COUNT, EDGE_MARGIN = EDGES.low, EDGES.step, EDGES.count, EDGES.margin
EDGE_VALUES = EDGES.values()


def log_mass(values: torch.Tensor, ref: torch.Tensor, sigma: float) -> torch.Tensor:
    """σ·(values − ref) in fp64; NaN where either is NaN. Shapes broadcast."""
    return sigma * (values.to(torch.float64) - ref.to(torch.float64))


def edge_bins(x: torch.Tensor, edges: ThresholdEdges = EDGES) -> torch.Tensor:
    """Number of edges <= x (x fp64 log-mass); NaN maps past the last edge (never below one)."""
    values = EDGE_VALUES if edges is EDGES else edges.values()
    return torch.bucketize(x.nan_to_num(nan=math.inf).contiguous(), values.to(x.device), right=True)


def pick_edge(mass_below: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """Largest edge index j with mass_below[..., j] <= budget; −1 if none.

    mass_below ``[S, H, E]`` (E edges), budget ``[S, H]`` -> ``[S, H]`` int64.
    """
    ok = mass_below <= budget.unsqueeze(-1)
    idx = torch.where(ok, torch.arange(ok.shape[-1], device=ok.device), -1)
    return idx.amax(dim=-1)


def edge_threshold(edge_idx: torch.Tensor, ref: torch.Tensor, sigma: float,
                   edges: ThresholdEdges = EDGES) -> torch.Tensor:
    """fp32 threshold ``[S, H]`` for edge indices (−1 -> −inf), placed just under the edge."""
    edge = edges.low + edges.step * edge_idx.clamp(min=0).to(torch.float64)  # = the edge's value, exactly
    t = ref.to(torch.float64) + (edge - edges.margin) / sigma
    t32 = t.to(torch.float32)
    t32 = torch.where(t32.to(torch.float64) > t, torch.nextafter(t32, torch.full_like(t32, -math.inf)), t32)
    t32 = torch.where(edge_idx < 0, -math.inf, t32)
    return torch.where(torch.isfinite(ref), t32, -math.inf)


def budget_threshold(sample_scores: torch.Tensor, sample_count: torch.Tensor, fraction: float) -> torch.Tensor:
    """The paper's budget rule: T = the ⌊f·M⌋-th largest sample score (at least the largest).

    sample_scores ``[B, M, H]`` fp32 padded with −inf; sample_count ``[B]`` -> ``[B, H]`` fp32
    (−inf for requests without samples).
    """
    b, m, h = sample_scores.shape
    if m == 0:
        return torch.full((b, h), -math.inf, device=sample_scores.device)
    k = (sample_count.to(torch.float64) * fraction).floor().clamp(min=1).long().clamp(max=m)
    ranked = sample_scores.topk(int(k.max()), dim=1).values  # only the top k matter (no full sort)
    pick = (k - 1)[:, None, None].expand(b, 1, h)
    t = torch.gather(ranked, 1, pick)[:, 0]
    return torch.where(sample_count[:, None] > 0, t, -math.inf)


def gate_threshold(t: torch.Tensor) -> torch.Tensor:
    """Value-gate threshold (``contract.VALUE_GATE``): a candidate skips its V read only if its
    exact score is clearly below T."""
    return VALUE_GATE.threshold(t)


def static_threshold(config: LouverConfig, batch: int, heads: int) -> torch.Tensor | None:
    """``config.threshold.static_threshold`` (dense, fixed) for every (request, head) ``[B, H_q]``
    fp32; None if the policy's T needs data."""
    value = config.threshold.static_threshold
    return None if value is None else torch.full((batch, heads), value)


def safe_level(ref: torch.Tensor, z_lb: torch.Tensor, num_indexed: torch.Tensor, sigma: float,
               eps_budget: float, rounding: float) -> torch.Tensor:
    """Provisional level of the one-pass certified rule (``certified_passes=1``), per (request,
    head): T_p = ref + ln(eps_budget·Z_lb / ((1 + rounding)·n)) / σ with n the request's indexed
    tokens, rounded down to fp32. Every unit the gate drops at T_p has its bound below T_p, so
    the mass dropped is below n·exp(σ(T_p − ref)), which fits: the check always passes (its
    rounding aside). −inf where nothing is indexed or a term is not finite.

    ref ``[B, H]`` fp32, z_lb ``[B, H]`` fp64, num_indexed ``[B]`` int -> ``[B, H]`` fp32.
    """
    n = num_indexed.to(torch.float64)[:, None]
    level = ref.to(torch.float64) + torch.log(eps_budget * z_lb / ((1.0 + rounding) * n)) / sigma
    t32 = level.to(torch.float32)
    t32 = torch.where(t32.to(torch.float64) > level, torch.nextafter(t32, torch.full_like(t32, -math.inf)), t32)
    return torch.where((n > 0) & torch.isfinite(level), t32, -math.inf)


def provisional_certified(dropped: torch.Tensor, z_lb: torch.Tensor, eps_budget: float,
                          rounding: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-pass check: (certified ``[B, H]`` bool, certificate ``[B, H]`` fp64). The gate's
    own dropped-mass bound (fp64, positive terms) times (1 + rounding) bounds the mass dropped
    whatever the summation order; it is the certificate where it fits eps_budget·Z_lb (NaN fails)."""
    certificate = dropped * (1.0 + rounding)
    return certificate <= eps_budget * z_lb, certificate


def lowered_to_safe(t0: torch.Tensor, dropped: torch.Tensor, z_att: torch.Tensor, ref: torch.Tensor,
                    num_indexed: torch.Tensor, sigma: float, eps_budget: float, rounding: float):
    """The check of the one-pass rule a posteriori (design notes, "Certified a posteriori in one
    pass"): a head whose gate at its provisional level t0 dropped a bound ``dropped`` that, times
    1 + rounding, fits eps_budget·Z_att keeps t0 with that product as its certificate; the others
    are lowered to the safe level at Z_att, where the mass dropped is below eps_budget·Z_att: their
    certificate (0 where that level is −inf). Returns (T ``[B, H]`` fp32, certificate ``[B, H]``
    fp64, lowered ``[B, H]`` bool).

    t0, ref ``[B, H]`` fp32; dropped, z_att ``[B, H]`` fp64; num_indexed ``[B]`` int.
    """
    ok, certificate = provisional_certified(dropped, z_att, eps_budget, rounding)
    t1 = safe_level(ref, z_att, num_indexed, sigma, eps_budget, rounding)
    lowered_cert = torch.where(t1 == -math.inf, 0.0, eps_budget * z_att)
    return torch.where(ok, t0, t1), torch.where(ok, certificate, lowered_cert), ~ok


def certified_choice(pb: torch.Tensor, tok: torch.Tensor, page_req: torch.Tensor, ref: torch.Tensor,
                     z_lb: torch.Tensor, sigma: float, eps_budget: float, rounding: float,
                     edges: ThresholdEdges = EDGES):
    """The certified rule every implementation follows (the compiled ``certified_threshold`` op
    and the Triton histogram kernels are tested against this): page bounds ``[NP, H_q]`` and token
    bounds ``[NP, P, H_q]`` fp32 -> (T ``[B, H_q]`` fp32, certificate ``[B, H_q]`` fp64, hist and
    habs ``[B, H_q, edges.count + 2]`` fp64).

    hist holds, per edge bin, pages whole at their bin and tokens below their page's bin at
    theirs, minus the same tokens at the page's bin (so that its cumulative sum at edge j is the
    mass dropped when pages and tokens share the level j); habs sums the absolute terms. The mass
    dropped at edge j is bounded by cumsum(hist)[j] + rounding·cumsum(habs)[j] (fp64 rounding of
    the sums in any order); T is the largest edge whose bound fits eps_budget·Z_lb, and the
    certificate is that bound (0 where no edge fits and T = −inf).
    """
    batch, heads = ref.shape
    size = tok.shape[1]
    tok = torch.minimum(tok, pb[:, None, :])
    x_page, x_tok = log_mass(pb, ref[page_req], sigma), log_mass(tok, ref[page_req][:, None, :], sigma)
    b_page, b_tok = edge_bins(x_page, edges), edge_bins(x_tok, edges)
    mass_page = size * torch.exp(x_page.clamp(max=700.0)).nan_to_num(nan=0.0)
    mass_tok = torch.exp(x_tok.clamp(max=700.0)).nan_to_num(nan=0.0) * (b_tok < b_page[:, None, :])
    width = edges.hist_width
    seg = (page_req[:, None] * heads + torch.arange(heads, device=ref.device)) * width
    parts = []
    for index, mass in (((seg + b_page), mass_page), ((seg[:, None, :] + b_tok), mass_tok),
                        ((seg + b_page), mass_tok.sum(1))):
        parts.append(torch.zeros(batch * heads * width, dtype=torch.float64, device=ref.device).index_add_(
            0, index.reshape(-1), mass.reshape(-1)).view(batch, heads, width))
    hist, habs = parts[0] + parts[1] - parts[2], parts[0] + parts[1] + parts[2]
    bound = histogram_bound(hist, habs, rounding, edges)
    edge = pick_edge(bound, eps_budget * z_lb)
    cert = torch.where(edge < 0, 0.0, bound.gather(-1, edge.clamp(min=0)[..., None])[..., 0])
    return edge_threshold(edge, ref, sigma, edges), cert, hist, habs


def histogram_bound(hist: torch.Tensor, habs: torch.Tensor, rounding: float,
                    edges: ThresholdEdges = EDGES) -> torch.Tensor:
    """The certified bound on the mass dropped at each edge, ``[B, H_q, edges.count]`` fp64, from
    the histograms of ``certified_choice``: the cumulative sum plus the bound on its rounding.
    Non-decreasing along the edges (raising the level only drops more)."""
    return (hist.cumsum(-1) + rounding * habs.cumsum(-1))[..., :edges.count]


def estimated_z(z_dense: torch.Tensor, z_sample: torch.Tensor, num_indexed: torch.Tensor,
                num_samples: torch.Tensor, share: float | torch.Tensor) -> torch.Tensor:
    """The a-posteriori rule's estimate of the softmax denominator, ``[B, H_q]`` fp64: the dense
    part plus the sample's exact mass scaled to the indexed tokens (n/M), times ``share`` (one
    float, or one per request ``[B]`` fp64), and never below the exact lower bound z_dense +
    z_sample (so the first level is never below the histogram rule's). z_dense, z_sample
    ``[B, H_q]`` fp64; counts ``[B]`` int."""
    if isinstance(share, torch.Tensor):
        share = share.to(z_dense.device, torch.float64)[:, None]
    n = num_indexed.to(torch.float64)[:, None]
    m = num_samples.to(torch.float64).clamp(min=1)[:, None]
    z_lb = z_dense + z_sample
    return torch.maximum(z_lb, share * (z_dense + z_sample * (n / m)))


def a_posteriori_first(bound: torch.Tensor, ref: torch.Tensor, z_est: torch.Tensor, sigma: float,
                       eps_budget: float, edges: ThresholdEdges = EDGES) -> tuple[torch.Tensor, torch.Tensor]:
    """The first level of the a-posteriori rule: the largest edge whose dropped-mass bound fits
    eps_budget·z_est. bound ``[B, H_q, E]`` (``histogram_bound``), ref ``[B, H_q]`` fp32,
    z_est ``[B, H_q]`` fp64 -> (edge index ``[B, H_q]`` int64, T0 ``[B, H_q]`` fp32)."""
    edge = pick_edge(bound, eps_budget * z_est)
    return edge, edge_threshold(edge, ref, sigma, edges)


def a_posteriori_second(bound: torch.Tensor, edge0: torch.Tensor, ref: torch.Tensor, z_att: torch.Tensor,
                        sigma: float, eps_budget: float, edges: ThresholdEdges = EDGES):
    """The check and the second level of the a-posteriori rule (design notes, "Certified a
    posteriori"). z_att ``[B, H_q]`` fp64 is the exact Σ exp(σ(s − ref)) over every key the first
    pass attended (the dense part and the GQA union of candidates at T0; at least the exact
    part's lower bound): a lower bound on the softmax denominator. Where bound(T0) fits
    eps_budget·z_att the head is certified at T0; elsewhere T1 is the largest edge whose bound
    fits eps_budget·z_att (T1 < T0, certified by construction, since the band's keys only add
    to z_att). A head whose first edge is −1 (no edge fits) keeps it: T = −inf drops nothing.

    Returns (edge ``[B, H_q]`` int64, T ``[B, H_q]`` fp32, certificate ``[B, H_q]`` fp64 = the
    bound at the final edge (0 at −1), band ``[B, H_q]`` bool: heads whose level was lowered)."""
    fits = bound.gather(-1, edge0.clamp(min=0)[..., None])[..., 0] <= eps_budget * z_att
    lowered = pick_edge(bound, eps_budget * z_att)
    band = (edge0 >= 0) & ~fits
    edge = torch.where(band, lowered, edge0)
    cert = torch.where(edge < 0, 0.0, bound.gather(-1, edge.clamp(min=0)[..., None])[..., 0])
    return edge, edge_threshold(edge, ref, sigma, edges), cert, band
