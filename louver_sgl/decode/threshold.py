"""Threshold policies and the certified dropped-mass accounting.

All mass arithmetic is in fp64 relative to a reference score ``m`` (the largest exact score known
this step), i.e. a unit with upper bound u and weight w has mass w·exp(σ·(u − m)).

Certified rule (design §4): with Z_lb = Σ exp(σ·(s − m)) over scores computed exactly this step,
choose T so that Σ over every dropped unit of w·exp(σ·(u − m)) ≤ ε·Z_lb, where the units are the
pages whose bound is below T (weight P) and the tokens below T in the other pages. Since every
dropped key has exact score ≤ u and Z_lb ≤ the true softmax denominator, the dropped softmax mass
is < ε. The candidate levels are the fixed edges ``EDGES`` (in units of σ·(T − m)), so the choice
is one histogram pass plus a cumulative sum; the dropped mass is then recounted exactly.
"""

from __future__ import annotations

import math

import torch

from ..config import LouverConfig

EDGE_LOW, EDGE_STEP, EDGE_COUNT = -48.0, 0.25, 257
EDGES = EDGE_LOW + EDGE_STEP * torch.arange(EDGE_COUNT, dtype=torch.float64)
# A unit strictly below an edge in fp64 log-mass space stays below the fp32 threshold built from that
# edge because the threshold is placed this far (in σ·score units) under the edge and rounded down.
EDGE_MARGIN = 1e-6
# Relative safety on budgets for the fp64 accumulation of up to ~1e8 positive terms.
BUDGET_SAFETY = 1.0 - 1e-7
# Relative bound on the fp64 rounding of the certified histograms' sums (terms added in any order,
# then a cumulative sum): 2·n·2^-53 with n < 2·10^7 terms per (request, head).
HIST_ROUNDING = 1e-8


def log_mass(values: torch.Tensor, ref: torch.Tensor, sigma: float) -> torch.Tensor:
    """σ·(values − ref) in fp64; NaN where either is NaN. Shapes broadcast."""
    return sigma * (values.to(torch.float64) - ref.to(torch.float64))


def edge_bins(x: torch.Tensor) -> torch.Tensor:
    """Number of edges <= x (x fp64 log-mass); NaN maps past the last edge (never below one)."""
    return torch.bucketize(x.nan_to_num(nan=math.inf).contiguous(), EDGES, right=True)


def pick_edge(mass_below: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """Largest edge index j with mass_below[..., j] <= budget; −1 if none.

    mass_below ``[S, H, E]``, budget ``[S, H]`` -> ``[S, H]`` int64.
    """
    ok = mass_below <= budget.unsqueeze(-1)
    idx = torch.where(ok, torch.arange(EDGE_COUNT, device=ok.device), -1)
    return idx.amax(dim=-1)


def edge_threshold(edge_idx: torch.Tensor, ref: torch.Tensor, sigma: float) -> torch.Tensor:
    """fp32 threshold ``[S, H]`` for edge indices (−1 -> −inf), placed just under the edge."""
    edge = EDGE_LOW + EDGE_STEP * edge_idx.clamp(min=0).to(torch.float64)  # = EDGES[idx], exactly
    t = ref.to(torch.float64) + (edge - EDGE_MARGIN) / sigma
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
    """Value-gate threshold: a candidate skips its V read only if its exact score is clearly
    below T, so that two evaluation orders of the same dot product gate the same keys."""
    return t - 1e-4 * (t.abs() + 1.0)


def static_threshold_value(config: LouverConfig) -> float | None:
    """T for the policies that need no data (fixed, dense); None otherwise."""
    if config.policy == "dense":
        return -math.inf
    if config.policy == "fixed":
        return float(config.fixed_threshold)
    return None


def static_threshold(config: LouverConfig, batch: int, heads: int) -> torch.Tensor | None:
    """``static_threshold_value`` for every (request, head) ``[B, H_q]`` fp32; None if the
    policy's T needs data."""
    value = static_threshold_value(config)
    return None if value is None else torch.full((batch, heads), value)
