"""Torch specifications of the compiled CPU step's phases (beside ``reference.reference_decode``,
the whole step's): each compiled op of ``impl_cpu`` is tested against its function here
(tests/test_cpu_ops.py). The certified threshold's pass is ``threshold.certified_choice``'s, the
exact part ``impl_torch.exact_part``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..index.grid import unpack_codes
from .contract import DecodePlan
from .segments import seg_sum


def step_stats_reference(t, z, per_head, per_req, masses, index_dropped, num_indexed, fallback_fraction, h_kv):
    """The specification of the compiled ``step_stats`` (which packs them, see
    ``StepStats.from_packed``): (threshold, candidates, pages_skipped, mass_bound, dense_fallback,
    counts) as new tensors (shapes in the op's comment) and whether any request falls back to
    dense. The bound is (index-dropped + value-gated mass) / Z with Z
    the larger of the exact part's lower bound and the dense part plus every union candidate;
    requests over the fallback fraction attend densely (bound 0, every indexed key a candidate,
    every V row read)."""
    fallback = per_req[:, 0] > fallback_fraction * (num_indexed * h_kv).clamp(min=1)
    z_final = torch.maximum(z[..., 0] + z[..., 1], z[..., 0] + masses[..., 2])
    dropped = index_dropped if index_dropped.numel() else masses[..., 0]
    bound = torch.where(fallback[:, None], 0.0, (dropped + masses[..., 1]) / z_final)
    candidates = torch.where(fallback[:, None], num_indexed[:, None], per_head[..., 0])
    counts = per_req.clone()
    counts[:, 1] = torch.where(fallback, num_indexed * h_kv, per_req[:, 1])  # dense reads every V row
    fields = (t.clone(), candidates, per_head[..., 1].clone(), bound, fallback, counts)
    return fields, bool(fallback.any())


def chunk_totals_reference(counts, mass, chunk_req, batch):
    """Per-request totals of the attend kernel's chunk outputs: per_head ``[B, H_q, 2]`` (attended,
    pages skipped), per_req ``[B, 3]`` (union candidates, values read, pages read of KV head 0's
    task), masses ``[B, H_q, 3]``. The specification of the compiled ``chunk_totals``."""
    n_chunks, h_kv, width = counts.shape
    groups = (width - 3) // 2
    heads = h_kv * groups
    per_head = seg_sum(torch.stack([counts[..., :groups], counts[..., groups: 2 * groups]], -1)
                       .reshape(n_chunks, heads, 2), chunk_req, batch)
    per_req = seg_sum(torch.stack([counts[..., 2 * groups].sum(1), counts[..., 2 * groups + 1].sum(1),
                                   counts[:, 0, 2 * groups + 2]], -1), chunk_req, batch)
    masses = seg_sum(mass.reshape(n_chunks, heads, 3), chunk_req, batch)
    return per_head, per_req, masses


@dataclass(frozen=True)
class Int8Rule:
    """The rule of the compiled token bounds' int8 weights (kernels/cpu/common.h): |wq| <= ``limit``,
    and where ``group_limit`` > 0 the step is at least the largest lane group's Σ|w| divided by it,
    so that Σ|wq| <= 128 in every group of channels whose code·weight products the AVX2 8-bit scan
    adds up in one int16 lane (channels 8b + 2p, 8b + 2p + 1, 8b + 2p + 4, 8b + 2p + 5). The
    Triton kernels' rule is the default one."""

    limit: int = 127
    group_limit: float = 0.0

    @classmethod
    def of_build(cls, bits: int) -> "Int8Rule":
        """The compiled CPU build's rule for codes of ``bits`` bits (the ``int8_weight_rule`` op)."""
        from .impl_cpu import compiled_ops

        limit, group_limit = compiled_ops().int8_weight_rule(bits=bits)
        return cls(int(limit), float(group_limit))

    def step(self, weights: torch.Tensor) -> torch.Tensor:
        """The int8 step of fp32 weights ``[..., D]``: ``[..., 1]``, as ``quantize_weights`` rounds it."""
        top = weights.abs().amax(-1, keepdim=True)
        step = torch.where(top > 0, top / float(self.limit), torch.ones_like(top))
        if self.group_limit <= 0:
            return step
        return torch.maximum(step, lane_group_sums(weights.abs()).amax(-1, keepdim=True) / self.group_limit)


def lane_group_sums(x: torch.Tensor) -> torch.Tensor:
    """Sums of ``x`` ``[..., D]`` over the AVX2 8-bit scan's int16 lane groups (channels 8b + 2p,
    8b + 2p + 1, 8b + 2p + 4, 8b + 2p + 5): ``[..., D/4]``, in ``lane_group_max``'s summation
    order, (x_a + x_b) + (x_c + x_d)."""
    halves = x.unflatten(-1, (-1, 2, 2, 2))  # [..., D/8, half, parity, pair member]
    pairs = halves[..., 0] + halves[..., 1]
    return (pairs[..., 0, :] + pairs[..., 1, :]).flatten(-2)


def _int8_weights(weights, bits, rule=Int8Rule()):
    """(step ``[..., 1]``, int8 wq as float, slack ``[...]``) of ``quantize_weights``: w ≈ step·wq
    under ``rule`` (``Int8Rule``), and slack bounds Σ (w − step·wq)·code over codes in [0, 2^bits − 1]
    with fp32 rounding (NaN where a weight is not finite); also Σ|step·wq| ``[...]``."""
    top = weights.abs().amax(-1, keepdim=True)
    step = rule.step(weights)
    wq = torch.round(weights * (1.0 / step)).clamp(-rule.limit, rule.limit)
    err = (weights - step * wq).clamp(min=0).sum(-1)
    mag = (step * wq).abs().sum(-1)
    slack = ((1 << bits) - 1) * (err * (1 + 2.0**-16) + mag * 2.0**-20) + 2.0**-126
    return step, wq, torch.where(torch.isfinite(top[..., 0]), slack, float("nan")), mag


def int8_token_bounds_reference(weights, offset, codes, bits, residual=False, weight_rule=Int8Rule()):
    """The attend pass's int8 token bounds: the specification of the compiled ones.

    Each head's page weights w (``grid_query_terms``) become ``step·wq`` with ``wq`` int8 under
    ``weight_rule`` (``Int8Rule``: step = max|w| / 127, rounded to nearest, or the compiled
    build's ``Int8Rule.of_build``, whose AVX2 8-bit scan also asks Σ|wq| <= 128 per int16 lane
    group); the bound is offset + slack + step·Σ wq·code with
    the integer sum exact, where slack covers the channels rounded down (codes are never negative)
    and fp32 rounding. With ``residual`` (``CpuLaunch.residual_weights``) the fp32 residual r = w −
    step·wq gets int8 weights of its own (``quantize_weights_residual``): the bound is offset +
    slack_r + (2^bits − 1)·2^-20·Σ|step·wq| + step·Σ wq·code + step_r·Σ wq_r·code. weights ``[n,
    H_kv, G, D]``, offset ``[n, H_kv, G]`` fp32; codes ``[n, P, H_kv, B]`` packed -> ``[n, P, H_kv,
    G]`` fp32.
    """
    step, wq, slack, mag = _int8_weights(weights, bits, weight_rule)
    levels = unpack_codes(codes, bits).long()
    dots = torch.einsum("npkd,nkgd->npkg", levels, wq.long())
    if not residual:
        return (offset + slack).unsqueeze(1) + step[..., 0].unsqueeze(1) * dots.float()
    # the residual rounded once from its exact value (step·wq is exact in fp64), as the kernels' fma
    residual_w = (weights.double() - step.double() * wq.double()).float()
    step_r, wq_r, slack_r, _ = _int8_weights(residual_w, bits, weight_rule)
    slack = torch.where(torch.isnan(slack), slack, slack_r + ((1 << bits) - 1) * mag * 2.0**-20)
    dots_r = torch.einsum("npkd,nkgd->npkg", levels, wq_r.long())
    first = (offset + slack).unsqueeze(1) + step[..., 0].unsqueeze(1) * dots.float()
    return first + step_r[..., 0].unsqueeze(1) * dots_r.float()


def merge_reference(ex, m, l, o, chunk_req, v_cache, plan: DecodePlan, sigma, batch) -> torch.Tensor:
    """Merge chunk softmax states (m in σ·score units) with the dense part: ``[B, H_q, D_v]``.

    The specification of the compiled ``merge_chunks`` (tested against it)."""
    n_chunks = len(chunk_req)
    heads, d_v = ex.s_dense.shape[1], v_cache.shape[-1]
    groups = heads // v_cache.shape[1]
    x_d = sigma * ex.s_dense  # [ND, H_q]
    m_c = m.view(n_chunks, heads)
    top = torch.full((batch, heads), float("-inf"))
    top.scatter_reduce_(0, plan.dense_req[:, None].expand_as(x_d), x_d, reduce="amax")
    top.scatter_reduce_(0, chunk_req[:, None].expand_as(m_c), m_c, reduce="amax")
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w_d = torch.exp(x_d - top[plan.dense_req])
    v_d = v_cache[plan.dense_slots].to(torch.float32).repeat_interleave(groups, dim=1)
    scale_c = torch.exp(m_c - top[chunk_req])  # 0 for empty chunks (m = −inf)
    den = seg_sum(w_d, plan.dense_req, batch) + seg_sum(l.view(n_chunks, heads) * scale_c, chunk_req, batch)
    num = seg_sum(w_d[..., None] * v_d, plan.dense_req, batch)
    num += seg_sum(o.view(n_chunks, heads, d_v) * scale_c[..., None], chunk_req, batch)
    return num / den[..., None]
