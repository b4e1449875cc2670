"""Streaming decode kernels of the GPU path: a filter pass that compacts survivors, then
split-K attention over the compacted lists. Specification: ``louver_sgl.decode.reference``
(the same attended set as ``grid_decode.attend``, which fuses both passes).

* ``filter_survivors``: one program per (request, KV head, segment of ``pages_per_split``
  pages), all of them independent, so a batch-1 step at 128K fills the GPU. Per page: the page
  bound (the page's scale folded into the query once), whole pages skipped below T, then the
  4- or 8-bit token bounds and the union over the GQA group. Every survivor — dense rows (sink,
  recent, tail) and indexed candidates — is written as (slot, head mask) into the segment's
  fixed-capacity list at its in-page prefix-sum position; the list length is the segment's
  count. A segment whose survivors pass its capacity keeps counting, writes no further entries,
  and the caller flags the request for dense attention on the device. Skipped pages, union
  candidates, pages whose codes were read and the index-dropped mass are written per segment.
* ``attend_survivors``: one program per (request, KV head, split); the splits share the
  request's survivors evenly whatever pages they came from (a prefix sum over the segment counts
  maps a list position to its segment), score the candidate keys exactly, apply the value gate
  and fold the attended rows into an online softmax that reads V only where some head attends.
  It writes the same split state as ``grid_decode.attend``, so ``grid_decode.merge`` and the
  dense fallback pass serve both.

No kernel reads a device value on the host; lists, counts and flags live in caller-owned
buffers, so the step is graph-safe for a fixed batch size and page-table width.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .grid_bounds import (
    MASS_UP, exact_scores, group_queries, load_codes, load_page_terms, lowered_mass, query_norms, quantize_weights,
    raised_mass, request_layout, round_up_f32, score_errors, token_bounds,
)
from .launch import TritonLaunch

INDEXED_BIT = tl.constexpr(30)  # head-mask bit marking an indexed (value-gated) survivor
MAX_GROUP = INDEXED_BIT.value  # query heads per KV head the mask can hold


@triton.jit
def _filter_kernel(
    q_ptr, table_ptr, lens_ptr, lo_ptr, sc_ptr, rad_ptr, codes_ptr, t_ptr, ref_ptr,
    slot_ptr, hmask_ptr, pos_ptr, seg_ptr, count_ptr, mass_ptr, drop64_ptr, flag_ptr,
    stride_qb, stride_qh, stride_tb, stride_ms, stride_mh, stride_cs, stride_ch, sigma, SPLIT, min_sparse,
    CAP, P: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, BITS: tl.constexpr,
    SINK: tl.constexpr, RECENT: tl.constexpr, POS_OUT: tl.constexpr, DROP64: tl.constexpr,
    FLAGGED: tl.constexpr,
):
    # DROP64: also the dropped-mass bound in fp64 (the one-pass certificate). FLAGGED: only the
    # requests flagged in flag_ptr run and write; the others' lists and counters stay as they are.
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    n_heads_kv = tl.num_programs(1)
    seq_len = tl.load(lens_ptr + b).to(tl.int64)
    pages, first, end = request_layout(seq_len, P, SINK, RECENT, min_sparse)
    if FLAGGED:
        runs = tl.load(flag_ptr + b) != 0
    else:
        runs = pages >= 0
    pages = tl.where(runs, pages, 0)
    g, gmask, head_row, q = group_queries(q_ptr, b, h, stride_qb, stride_qh, G, BG, D)
    t = tl.load(t_ptr + head_row, mask=gmask, other=float("inf"))
    ref = tl.load(ref_ptr + head_row, mask=gmask, other=0.0)
    tok = tl.arange(0, P)
    split_row = (b * n_heads_kv + h) * tl.num_programs(2) + s
    list_base = split_row.to(tl.int64) * CAP
    n_seg = 0
    n_skip = tl.zeros((BG,), tl.int32)
    n_union = 0
    n_read = 0
    dropped = tl.zeros((BG,), tl.float64)
    dropped64 = tl.zeros((BG,), tl.float64)
    ref64 = ref.to(tl.float64)
    p0 = s * SPLIT
    for p in range(p0, tl.minimum(p0 + SPLIT, pages)):
        page = tl.load(table_ptr + b * stride_tb + p).to(tl.int64)
        slots = page * P + tok
        valid = (p * P + tok) < seq_len
        keep = valid[:, None] & gmask[None, :]  # dense rows: every valid token, every head
        is_idx = ((p >= first) & (p < end)).to(tl.int32)
        if is_idx > 0:
            w, offset, pb = load_page_terms(lo_ptr, sc_ptr, rad_ptr, page, h, stride_ms, stride_mh, q, D, BITS)
            keep_page = ((pb >= t) | (pb != pb)) & gmask
            skip = gmask & (keep_page == 0)
            n_skip += skip.to(tl.int32)
            dropped += tl.where(skip, P * tl.exp(sigma * (pb - ref)), 0.0).to(tl.float64) * MASS_UP
            if DROP64:
                dropped64 += tl.where(skip, P * tl.exp(sigma * (pb.to(tl.float64) - ref64)), 0.0)
            keep = keep & keep_page[None, :]
            if tl.max(keep_page.to(tl.int32), 0) > 0:  # codes only of pages some head keeps
                n_read += 1
                wq, step, err = quantize_weights(w, BITS)
                codes = load_codes(codes_ptr, slots, h, stride_cs, stride_ch, D, BITS, p < end)
                u = token_bounds(codes, wq, step, err, offset)
                keep_tok = keep & ((u >= t[None, :]) | (u != u))
                lost = keep & (keep_tok == 0)
                u_lost = tl.minimum(u, pb[None, :])
                dropped += tl.sum(tl.where(lost, tl.exp(sigma * (u_lost - ref[None, :])), 0.0), 0).to(tl.float64) * MASS_UP
                if DROP64:
                    dropped64 += tl.sum(tl.where(lost, tl.exp(sigma * (u_lost.to(tl.float64) - ref64[None, :])), 0.0), 0)
                keep = keep_tok
        row = tl.max(keep.to(tl.int32), 1) > 0
        found = tl.sum(row.to(tl.int32), 0)
        if found > 0:  # compact the page's survivors after the segment's earlier ones
            dest = n_seg + tl.cumsum(row.to(tl.int32), 0) - 1
            fits = row & (dest < CAP)
            heads = tl.sum(tl.where(keep, 1 << g[None, :], 0), 1) | (is_idx << INDEXED_BIT)
            tl.store(slot_ptr + list_base + dest, slots.to(tl.int32), mask=fits)
            tl.store(hmask_ptr + list_base + dest, heads, mask=fits)
            if POS_OUT:
                tl.store(pos_ptr + list_base + dest, (p * P + tok).to(tl.int32), mask=fits)
            n_seg += found
            n_union += found * is_idx
    tl.store(seg_ptr + split_row, n_seg, mask=runs)
    counts = count_ptr + split_row * 5 * BG + g
    tl.store(counts + BG, n_skip, mask=runs)
    tl.store(counts + 2 * BG, tl.where(g == 0, n_union, 0), mask=runs)
    tl.store(counts + 4 * BG, tl.where(g == 0, n_read, 0), mask=runs)
    tl.store(mass_ptr + split_row * 2 * BG + g, round_up_f32(dropped), mask=runs)
    if DROP64:
        tl.store(drop64_ptr + split_row * BG + g, dropped64, mask=runs)


@triton.jit
def _survivor_entries(seg_counts, seg_ends, idx, list_row, CAP):
    """List offsets ``[N]`` (int64) of positions ``idx`` ``[N]`` in the concatenation of the
    segments' lists: segment = number of segment ends <= idx, offset within it = idx minus the
    counts of those segments."""
    before = seg_ends[None, :] <= idx[:, None]
    seg = tl.sum(before.to(tl.int32), 1)
    local = idx - tl.sum(tl.where(before, seg_counts[None, :], 0), 1)
    return (list_row + seg).to(tl.int64) * CAP + local


@triton.jit
def _attend_survivors_kernel(
    q_ptr, k_ptr, v_ptr, slot_ptr, hmask_ptr, pos_ptr, seg_ptr, t_ptr, flag_ptr,
    m_ptr, l_ptr, o_ptr, count_ptr, mass_ptr, keep_ptr, ref_ptr, zown_ptr,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_kb, sigma, CAP,
    S: tl.constexpr, SP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, G: tl.constexpr, BG: tl.constexpr,
    BLOCK_N: tl.constexpr, QHI: tl.constexpr, PV: tl.constexpr, GATE: tl.constexpr, GATE_REL: tl.constexpr,
    KEEP_OUT: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    n_heads_kv = tl.num_programs(1)
    g, gmask, head_row, q = group_queries(q_ptr, b, h, stride_qb, stride_qh, G, BG, D)
    t = tl.load(t_ptr + head_row, mask=gmask, other=float("inf"))
    if GATE:
        gate_t = t - GATE_REL * (tl.abs(t) + 1.0)
    else:
        gate_t = tl.full((BG,), float("-inf"), tl.float32)
    ref = tl.load(ref_ptr + head_row, mask=gmask, other=0.0)
    list_row = (b * n_heads_kv + h) * S
    segs = tl.arange(0, SP)
    seg_counts = tl.minimum(tl.load(seg_ptr + list_row + segs, mask=segs < S, other=0), CAP)
    seg_ends = tl.cumsum(seg_counts, 0)
    total = tl.sum(seg_counts, 0)
    chunk = tl.cdiv(tl.cdiv(total, S), BLOCK_N) * BLOCK_N
    start = s * chunk
    stop = tl.minimum(start + chunk, total)
    stop = tl.where(tl.load(flag_ptr + b) != 0, start, stop)  # flagged: the dense fallback pass writes it
    dim = tl.arange(0, D)
    dv = tl.arange(0, DV)
    m_i = tl.full((BG,), float("-inf"), tl.float32)
    l_i = tl.zeros((BG,), tl.float32)
    acc = tl.zeros((BG, DV), tl.float32)
    n_att = tl.zeros((BG,), tl.int32)
    n_values = 0
    gated = tl.zeros((BG,), tl.float64)
    z_own = tl.zeros((BG,), tl.float64)
    q_norm = query_norms(q)
    for i0 in range(start, stop, BLOCK_N):
        idx = i0 + tl.arange(0, BLOCK_N)
        live = idx < stop
        entry = _survivor_entries(seg_counts, seg_ends, idx, list_row, CAP)
        slots = tl.load(slot_ptr + entry, mask=live, other=0).to(tl.int64)
        heads = tl.load(hmask_ptr + entry, mask=live, other=0)
        keys = tl.load(k_ptr + slots[:, None] * stride_ks + h * stride_kh + dim[None, :], mask=live[:, None],
                       other=0.0)
        sc_exact = exact_scores(keys, q, QHI)
        is_idx = ((heads >> INDEXED_BIT) & 1) != 0
        keep = (((heads[:, None] >> g[None, :]) & 1) != 0) & live[:, None] & gmask[None, :]
        row_gate = tl.where(is_idx[:, None], gate_t[None, :], float("-inf"))
        # a NaN score is never below the gate (keep semantics, as the torch and C++ steps)
        att = keep & ((sc_exact >= row_gate) | (sc_exact != sc_exact))
        sc_err = score_errors(keys, q_norm, D)
        gated += raised_mass(sc_exact, sc_err, ref, keep & (att == 0), sigma)
        z_own += lowered_mass(sc_exact, sc_err, ref, att, sigma)
        x = tl.where(att, sigma * sc_exact, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(x, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        prob = tl.exp(x - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(prob, 0)
        vrow = tl.max(att.to(tl.int32), 1) > 0  # values only where some head attends
        vals = tl.load(v_ptr + slots[:, None] * stride_vs + h * stride_vh + dv[None, :], mask=vrow[:, None],
                       other=0.0)
        if PV == tl.float32:
            acc = acc * alpha[:, None] + tl.dot(tl.trans(prob), vals, input_precision="ieee")
        else:
            acc = tl.dot(tl.trans(prob).to(PV), vals, acc=acc * alpha[:, None], out_dtype=tl.float32)
        m_i = m_new
        n_att += tl.sum((att & is_idx[:, None]).to(tl.int32), 0)
        n_values += tl.sum((vrow & is_idx).to(tl.int32), 0)
        if KEEP_OUT:
            pos = tl.load(pos_ptr + entry, mask=live, other=0).to(tl.int64)
            tl.store(keep_ptr + head_row[None, :] * stride_kb + pos[:, None], att.to(tl.int8), mask=keep)
    split_row = list_row + s
    runs = tl.load(flag_ptr + b) == 0
    tl.store(m_ptr + split_row * BG + g, m_i, mask=runs)
    tl.store(l_ptr + split_row * BG + g, l_i, mask=runs)
    tl.store(o_ptr + (split_row * BG + g[:, None]) * DV + dv[None, :], acc, mask=runs)
    counts = count_ptr + split_row * 5 * BG + g
    tl.store(counts, n_att)
    tl.store(counts + 3 * BG, tl.where(g == 0, n_values, 0))
    tl.store(mass_ptr + split_row * 2 * BG + BG + g, round_up_f32(gated))
    tl.store(zown_ptr + split_row * BG + g, z_own, mask=runs)


def segment_capacity(launch: TritonLaunch, page_size: int) -> int:
    """Entries of one segment's survivor list: ``survivor_percent`` of its tokens, at least a page."""
    tokens = launch.pages_per_split * page_size
    return max(page_size, -(-tokens * launch.survivor_percent // 100))


def filter_survivors(q, page_table, seq_lens, index: dict, threshold, ref, lists: dict, counts, mass,
                     sigma: float, layout: dict, min_sparse: int, bits: int, launch: TritonLaunch,
                     positions: bool = False, dropped64=None, flagged=None) -> None:
    """Filter pass: survivors of every (request, KV head, segment) compacted into its list.

    Args:
        q: ``[B, H_q, D]``; page_table ``[B, W]``; seq_lens ``[B]``; index: grid tensors (as in
            ``grid_decode.certified_hist``); threshold, ref: ``[B, H_q]`` fp32.
        lists: ``slot``, ``heads`` (and ``pos`` where ``positions``) ``[B, H_kv, S, C]`` int32 out:
            KV slot, head mask (bit g: query head g of the group keeps it; bit 30: indexed) and
            token position of each survivor; ``count`` ``[B, H_kv, S]`` int32 out: survivors per
            segment (may exceed C: the request overflowed). C = ``segment_capacity``.
        counts: ``[B, H_kv, S, 5, BG]`` int32: columns 1 (skipped pages per head), 2 (union
            candidates) and 4 (pages whose codes were read) written here, 0 and 3 by
            ``attend_survivors``. mass: ``[B, H_kv, S, 2, BG]`` fp32: column 0 (index-dropped mass).
        dropped64: optional ``[B, H_kv, S, BG]`` fp64 out: the same dropped mass in fp64 (positive
            terms: the one-pass certificate, ``threshold.provisional_certified``).
        flagged: optional ``[B]`` bool: only these requests are filtered (and written).
    """
    batch, heads, dim = q.shape
    lo = index["lo"]
    h_kv = lo.shape[1]
    groups = heads // h_kv
    slot = lists["slot"]
    grid = (batch, h_kv, slot.shape[2])
    _filter_kernel[grid](
        q, page_table, seq_lens, lo, index["scale"], index["radius"], index["codes"], threshold, ref,
        slot, lists["heads"], lists["pos"] if positions else slot, lists["count"], counts, mass,
        dropped64 if dropped64 is not None else mass, flagged if flagged is not None else seq_lens,
        q.stride(0), q.stride(1), page_table.stride(0), lo.stride(0), lo.stride(1), index["codes"].stride(0),
        index["codes"].stride(1), float(sigma), launch.pages_per_split, int(min_sparse), slot.shape[3], **layout,
        D=dim, G=groups, BG=counts.shape[-1], BITS=bits, POS_OUT=positions, DROP64=dropped64 is not None,
        FLAGGED=flagged is not None, num_warps=launch.filter_warps, num_stages=launch.filter_stages,
    )


def attend_survivors(q, k_cache, v_cache, lists: dict, threshold, ref, fallback, m, l, o, counts, mass, z_own,
                     sigma: float, gate: bool, gate_rel: float, pv_dtype, launch: TritonLaunch,
                     attended=None) -> None:
    """Split-K attention over the compacted survivors (``filter_survivors``' lists).

    Args:
        q ``[B, H_q, D]``; k_cache ``[slots, H_kv, D]``; v_cache ``[slots, H_kv, D_v]``.
        threshold, ref: ``[B, H_q]`` fp32. fallback: ``[B]`` bool: flagged requests write no split
            state (the dense fallback pass does).
        m, l, o, counts, mass, z_own: the split state and counters of ``grid_decode.attend``
            (columns 0 and 3 of counts, column 1 of mass written here).
        gate: candidates scoring below T − gate_rel·(|T| + 1) skip their V read.
        pv_dtype: the Triton dtype of the P·V product (the KV dtype).
        attended: optional ``[B, H_q, W * P]`` int8 out (callers zero it): 1 where attended.
    """
    batch, heads, dim = q.shape
    h_kv, d_v = k_cache.shape[1], v_cache.shape[2]
    splits = lists["slot"].shape[2]
    grid = (batch, h_kv, splits)
    _attend_survivors_kernel[grid](
        q, k_cache, v_cache, lists["slot"], lists["heads"], lists["pos"] if attended is not None else lists["slot"],
        lists["count"], threshold, fallback, m, l, o, counts, mass,
        attended if attended is not None else counts, ref, z_own,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        attended.stride(1) if attended is not None else 0, float(sigma), lists["slot"].shape[3],
        S=splits, SP=triton.next_power_of_2(splits), D=dim, DV=d_v, G=heads // h_kv, BG=counts.shape[-1],
        BLOCK_N=launch.survivor_block, QHI=pv_dtype, PV=pv_dtype, GATE=gate, GATE_REL=float(gate_rel),
        KEEP_OUT=attended is not None, num_warps=launch.survivor_warps,
        num_stages=launch.survivor_stages,
    )
