"""The louver decode step with its attended key set made visible, for evaluations.

``louver_decode`` reports counts, not which keys it attended. Evaluations that check recall
against an fp64 brute force or measure the dropped softmax mass need the set itself, so this runs
the vectorised torch step (``step.run_decode``) from the same building blocks, in the same order,
and also returns the attended mask. ``tests/test_eval_attended.py`` checks that output and stats
equal ``louver_decode(backend="torch")`` bit for bit, so this cannot drift from the real step. The
compiled CPU kernel attends a superset of these keys (its int8 token bounds are looser).
"""

from __future__ import annotations

import torch

from ..config import LouverConfig
from ..decode import step
from ..decode.filter import run_filter
from ..decode.plan import DecodePlan, plan_decode
from ..index.store import PageIndexStore


def louver_step_attended(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    store: PageIndexStore,
    sigma: float,
    config: LouverConfig | None = None,
) -> tuple[torch.Tensor, step.StepStats, list[torch.Tensor]]:
    """One louver decode step (torch path) plus the keys it attended.

    Args: as ``louver_decode``: q ``[B, H_q, D]``, k/v caches ``[slots, H_kv, D]``, page_table
        ``[B, max_pages]``, seq_lens ``[B]``.

    Returns ``(out [B, H_q, D_v], stats, attended)`` where ``attended[b]`` is a bool
    ``[H_q, seq_lens[b]]`` mask over request b's token positions (dense part, attended
    candidates, or everything under a dense fallback).
    """
    config = config or store.config
    step._check_inputs(q, k_cache, v_cache, store, config)
    plan = plan_decode(page_table, seq_lens, config)
    batch = q.shape[0]
    q32 = q.to(torch.float32)
    ex = step.exact_part(q32, k_cache, plan, sigma)
    rows = q32.view(batch, store.num_kv_heads, -1, q.shape[-1])[plan.page_req]
    bounds = store.page_bounds(rows, plan.page_ids)
    filt = run_filter(store, bounds, plan.page_ids, plan.page_req, ex.ref, ex.z_lb, ex.sample, sigma, config)
    fallback = step._fallback_mask(filt, plan, store.num_kv_heads, config)
    cand = step._candidates(q32, k_cache, filt, plan, fallback)
    gate = step._value_gate(cand, filt, ex.ref, ex.z_dense, ex.z_lb, sigma, config, batch)
    result = step._attend(q32, ex.s_dense, cand, gate, v_cache, plan, sigma, batch)
    result = step._dense_for(fallback, result, q32, k_cache, v_cache, plan, sigma)
    out = result.to(q.dtype)
    stats = step._stats(filt, cand, gate, plan, fallback, batch)
    attended = _attended_masks(cand, gate, plan, fallback, page_table, q.shape[1], k_cache.shape[0])
    return out, stats, attended


def _attended_masks(cand, gate, plan: DecodePlan, fallback, page_table, heads: int, num_slots: int):
    """Per request, bool ``[H_q, L]``: which token positions each query head attended."""
    size = plan.page_size
    masks = []
    for b, n in enumerate(plan.seq_lens.tolist()):
        if bool(fallback[b]):
            masks.append(torch.ones((heads, n), dtype=torch.bool))
            continue
        pos = torch.arange(n)
        slot_to_pos = torch.full((num_slots,), -1, dtype=torch.long)
        slot_to_pos[page_table[b].long()[pos // size] * size + pos % size] = pos
        mask = torch.zeros((heads, n), dtype=torch.bool)
        mask[:, slot_to_pos[plan.dense_slots[plan.dense_req == b]]] = True
        mine = cand.req == b
        flat = cand.seg[mine]  # [Nc_b, G] flat (request, head) ids
        positions = slot_to_pos[cand.slots[mine]][:, None].expand_as(flat)
        attend = gate.attend[mine]
        mask[flat[attend] - b * heads, positions[attend]] = True
        masks.append(mask)
    return masks
