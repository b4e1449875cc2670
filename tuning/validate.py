"""Hard constraints of a trial, checked against an fp64 brute force on a validation set.

For every request and query head of a decode step:
  * zero false negatives: every indexed key whose exact fp64 score reaches the step's threshold T
    passes the index's bounds (the attended set of the reference semantics, with the int8 token
    bounds where the step ran the compiled kernels: they gate and certify with those);
  * the dropped softmax mass (keys outside that set and the dense part) is at most the step's
    certified bound, and with the certified policy the bound is below eps;
  * the step's output is within the guarantee ||o - o_dense|| <= 2 * bound * max||v|| of fp64
    dense attention, plus an fp32 accumulation allowance.
A violation raises ``ConstraintViolation``; the tuner records the trial as failed (rejected).
"""

from __future__ import annotations

import torch

from louver_sgl import LouverConfig, PageIndexStore
from louver_eval.data.paged import PagedBatch
from louver_sgl.decode.api import resolve_implementation, uses_int8_token_bounds
from louver_sgl.decode.contract import StepStats
from louver_sgl.decode.reference_compiled import Int8Rule, int8_token_bounds_reference
from louver_sgl.decode.plan import split_pages
from louver_sgl.index.numerics import keep_at_least

# fp32 step vs fp64 reference: a relative allowance on max||v|| for accumulation rounding.
OUTPUT_FP32_ALLOWANCE = 1e-4


class ConstraintViolation(Exception):
    """A trial broke a hard constraint (exactness or the certified mass bound)."""


def check_step(batch: PagedBatch, store: PageIndexStore, config: LouverConfig, out: torch.Tensor,
               stats: StepStats, impl: str = "auto", residual_weights: bool = False) -> None:
    """Raise ``ConstraintViolation`` naming the request and the broken constraint.

    Args:
        batch: q ``[B, H_q, D]``, paged k/v ``[slots, H_kv, D]``, page_table ``[B, pages]``, seq_lens ``[B]``.
        out: the step's output ``[B, H_q, D]``; stats: its ``StepStats`` (threshold, mass_bound ``[B, H_q]``).
        impl: the decode implementation that ran the step (``auto``: the one ``LouverDecode`` picks).
        residual_weights: the compiled CPU step ran with residual int8 weights (its launch's
            ``residual_weights``): its token bounds are ``int8_token_bounds_reference(...,
            residual=True)``.
    """
    if not config.threshold.certifies(stats.mass_bound):
        raise ConstraintViolation(f"certified bound {float(stats.mass_bound.max()):.3g} >= eps {config.eps}")
    resolved = resolve_implementation(impl, config, batch.k.device)
    int8 = uses_int8_token_bounds(resolved)
    bounds = ("residual" if residual_weights and resolved == "cpu" else "int8") if int8 else "fp32"
    # the compiled CPU build's int8 weight rule (lane groups for 8-bit codes on AVX2 builds); the GPU's ±127
    rule = Int8Rule.of_build(config.grid_bits) if int8 and resolved == "cpu" else Int8Rule()
    for b in range(batch.q.shape[0]):
        _check_request(batch, store, config, out, stats, b, bounds, rule)


def _check_request(batch: PagedBatch, store: PageIndexStore, config: LouverConfig, out: torch.Tensor,
                   stats: StepStats, b: int, bounds: str, weight_rule: Int8Rule = Int8Rule()) -> None:
    size, n = config.page_size, int(batch.seq_lens[b])
    pos = torch.arange(n)
    slots = batch.page_table[b].cpu().long()[pos // size] * size + pos % size
    keys, values = batch.k.cpu()[slots], batch.v.cpu()[slots]
    q = batch.q[b].cpu()
    groups = q.shape[0] // keys.shape[1]
    scores = torch.einsum("hd,nhd->hn", q.double(), keys.double().repeat_interleave(groups, 1))  # [H_q, n]
    threshold = stats.threshold[b].cpu()
    passed = _passed(store, q, batch.page_table[b].cpu().long(), n, config, threshold, bounds,
                     weight_rule)  # [H_q, n] or None
    attended = torch.ones_like(scores, dtype=torch.bool)
    if passed is not None and not bool(stats.dense_fallback[b]):
        indexed = passed[1]
        missed = (scores[:, indexed] >= threshold.double()[:, None]) & ~passed[0]
        if bool(missed.any()):
            raise ConstraintViolation(f"request {b}: {int(missed.sum())} false negatives (recall < 1)")
        attended[:, indexed] = passed[0]
    probs = torch.softmax(batch.sigma * scores, dim=1)
    dropped = (probs * ~attended).sum(1)
    bound = stats.mass_bound[b].cpu().double()
    if bool((dropped > bound + 1e-12).any()):
        raise ConstraintViolation(f"request {b}: dropped mass {float(dropped.max()):.3g} exceeds the "
                                  f"reported bound {float(bound.max()):.3g}")
    dense = torch.einsum("hn,nhd->hd", probs, values.double().repeat_interleave(groups, 1))
    err = (out[b].cpu().double() - dense).norm(dim=-1)
    v_max = float(values.double().norm(dim=-1).max())
    limit = (2 * bound + OUTPUT_FP32_ALLOWANCE) * v_max
    if bool((err > limit).any()):
        raise ConstraintViolation(f"request {b}: output error {float(err.max()):.3g} exceeds "
                                  f"2 * bound * max|v| (+ fp32 allowance) = {float(limit.max()):.3g}")


def _passed(store: PageIndexStore, q: torch.Tensor, pages_row: torch.Tensor, n: int, config: LouverConfig,
            threshold: torch.Tensor, bounds: str, weight_rule: Int8Rule = Int8Rule()):
    """(keys passing the bounds ``[H_q, n_indexed]`` bool, their positions ``[n_indexed]``), or None.

    ``bounds``: "int8" (or "residual", with residual int8 weights): the step gated with the compiled
    kernels' int8 token bounds (and certified its T with them), so those decide which keys each head
    keeps; "fp32": the store's fp32 bounds.
    """
    size = config.page_size
    _, indexed, _ = split_pages(n, config)
    pages = pages_row[indexed.start:indexed.stop].to(next(iter(store.tensors.values())).device)
    if len(pages) == 0:
        return None
    groups = q.shape[0] // store.num_kv_heads
    rows = q.float().view(1, store.num_kv_heads, groups, -1).expand(len(pages), -1, -1, -1).contiguous()
    terms = store.page_bounds(rows.to(pages.device), pages)
    if bounds != "fp32":
        codes = store.page_codes(pages)
        tok = int8_token_bounds_reference(*terms.terms, codes, store.config.grid_bits, bounds == "residual",
                                          weight_rule)
    else:
        tok = store.token_bounds(terms, pages)
    tok = tok.reshape(-1, q.shape[0]).t().cpu()
    page_bound = terms.page_bound.reshape(len(pages), -1).t().repeat_interleave(size, 1).cpu()
    passed = keep_at_least(torch.minimum(tok, page_bound), threshold[:, None])
    positions = torch.arange(indexed.start * size, indexed.stop * size)
    return passed, positions
