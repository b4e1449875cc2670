"""Outward rounding and the floating-point slack that keep the bounds sound.

Every stored radius is rounded *up* into its storage dtype after being computed in fp64 from the
stored center and the stored key. Query-side bounds are evaluated in fp32; the slack returned by
``dot_slack`` covers the rounding of any fp32 evaluation order of those sums (the classic
γ_n·Σ|terms| bound, with a generous margin), so comparing ``bound + slack`` against T never drops
a key whose exact score reaches T.
"""

from __future__ import annotations

import torch

FP32_UNIT_ROUNDOFF = 2.0**-24


def round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast ``x`` (any float dtype, typically fp64) to ``dtype`` rounding towards +inf.

    NaN stays NaN and +inf stays +inf, so a broken bound later means "keep".
    """
    y = x.to(dtype)
    low = y.to(torch.float64) < x.to(torch.float64)
    if bool(low.any()):
        y = torch.where(low, torch.nextafter(y, torch.full_like(y, float("inf"))), y)
    return y


def round_down(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast ``x`` to ``dtype`` rounding towards −inf."""
    y = x.to(dtype)
    high = y.to(torch.float64) > x.to(torch.float64)
    if bool(high.any()):
        y = torch.where(high, torch.nextafter(y, torch.full_like(y, float("-inf"))), y)
    return y


def dot_slack(magnitude: torch.Tensor, num_terms: int) -> torch.Tensor:
    """Absolute error bound for an fp32 evaluation of a sum of ``num_terms`` products.

    ``magnitude`` is Σ|term| (fp32, any shape). The factor 2·(n + 8)·u exceeds γ_n = n·u/(1 − n·u)
    for every n used here, and also covers the fp32 rounding of centers and norms computed on the
    fly (a few ulps each). The absolute term covers products that fall into fp32's subnormal range
    (each such rounding errs by at most 2**-150, times a code of at most 255).
    """
    return magnitude * (2.0 * (num_terms + 8) * FP32_UNIT_ROUNDOFF) + (num_terms + 8) * 2.0**-130


def score_slack(q_norm: torch.Tensor, k_norm: torch.Tensor, dim: int) -> torch.Tensor:
    """fp64 bound on the error of an fp32 score q·k (any summation order) from norm bounds
    ``q_norm``, ``k_norm`` (broadcast): ``dot_slack`` of ‖q‖·‖k‖ ≥ Σ|q_d·k_d| with D + 2
    terms (the two extra cover the rounding of the product and of the lowered score). Lower bounds
    of Z take every exact score as s − slack, so they bound the true keys' mass, not the fp32
    scores'."""
    return dot_slack(q_norm.to(torch.float64) * k_norm.to(torch.float64), dim + 2)


def norm_up(x: torch.Tensor) -> torch.Tensor:
    """Euclidean norm over the last dim, computed in fp64 (no fp32 underflow of tiny queries)
    and rounded up to fp32."""
    return round_up(x.to(torch.float64).norm(dim=-1), torch.float32)


def keep_at_least(bound: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """``bound >= threshold`` where NaN bounds keep (never drop on a NaN comparison)."""
    return ~(bound < threshold)
