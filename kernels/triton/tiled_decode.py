"""Tiled decode kernels of the GPU path: a filter over page tiles that fills the whole GPU and
compacts survivors into one list per (request, KV head), then split-K attention over those lists
with the GQA group folded onto each row. Specification: ``louver_sgl.decode.reference``.

* ``tile_filter``: one program per (request, KV head, tile of ``TP`` indexed pages), all
  independent: a 128K batch-1 Llama-3-8B step at TP = 4 is 4,096 programs. The tile's
  (page, query head) pairs are the ``TP·GP`` rows of one integer tensor-core dot against the
  tile's ``TP·P`` token codes (GP = the GQA group padded to a power of two), so the page terms of
  every row are real work and a program issues all its loads at once; the block diagonal of
  the product (each page's tokens against its own rows) gives the token bounds. Per page and head
  the page bound, whole pages below the gate skipped, token bounds against the gate, the GQA
  union. Survivors are written as KV slots into the (request, KV head) list: with ``ATOMIC`` at
  an offset from one atomic per tile (order unspecified), else into the tile's own fixed region
  (deterministic), which ``compact_lists`` copies to its place after a prefix sum. With
  ``WINDOW`` (the certified histogram rule in one pass over the codes) the gate is the window's
  lowest edge; the tile adds, per head and for every window edge, the mass of the units below
  it, and each survivor carries per head the number of window edges at or below its bound.
* ``window_threshold``: per (request, KV head) the highest window edge whose mass fits
  eps·Z_lb, T just above it, the certificate; a request whose lowest window edge does not fit
  is flagged (it attends densely).
* ``tiled_attend``: one program per (request, KV head, split); the dense rows (sink, recent,
  tail, from the page table) and the list's rows are shared evenly by the splits that the row
  count needs (at most ``S``; the others write an empty state). Every head of the group attends
  every union row (the budget and fixed policies' value gate aside, per head by its exact
  score); certified rows below the chosen window edge for every head read no key. A flagged
  request is attended densely. It writes ``grid_decode.attend``'s split state, so
  ``grid_decode.merge`` serves it.

No kernel reads a device value on the host; lists, counts and flags live in caller-owned
buffers, so the step is graph-safe for a fixed batch size and page-table width.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .grid_bounds import (
    MASS_UP, exact_scores, group_queries, lowered_mass, page_terms_and_slack, query_norms, quantize_weights,
    raised_mass, request_layout, round_up_f32, score_errors,
)
from .launch import TritonLaunch


@triton.jit
def _diagonal(x, TP: tl.constexpr, GP: tl.constexpr, P: tl.constexpr):
    """The block diagonal ``[TP, GP, P]`` of ``x`` ``[TP·GP, TP·P]``: each page's tokens against
    its own (page, head) rows."""
    x4 = tl.reshape(x, (TP, GP, TP, P))
    j = tl.arange(0, TP)
    same = (j[:, None, None, None] == j[None, None, :, None])
    return tl.sum(tl.where(same, x4, 0.0), 2)


@triton.jit
def _per_page(x, TP: tl.constexpr, GP: tl.constexpr):
    """``[TP·GP]`` (rows page-major) as ``[TP, GP]``."""
    return tl.reshape(x, (TP, GP))


@triton.jit
def _window_base(z_lb, n_idx, eps_budget, rounding, sigma, EDGE_LOW: tl.constexpr, EDGE_STEP: tl.constexpr,
                 EDGE_COUNT: tl.constexpr, START: tl.constexpr):
    """The window's lowest edge per head ``[...]`` int32: the safe level's edge (the highest at
    which n indexed tokens, each just below it, fit eps·Z_lb) plus START, at least 0."""
    n = tl.maximum(n_idx.to(tl.float64), 1.0)
    level = tl.log(eps_budget * z_lb / ((1.0 + rounding) * MASS_UP * n))  # σ·(T − ref) units
    e = tl.floor((level - EDGE_LOW) / EDGE_STEP)
    e = tl.where(level == level, e, -1.0)
    e = tl.minimum(tl.maximum(e, -1.0), EDGE_COUNT - 1.0)
    return tl.maximum(e.to(tl.int32) + START, 0)


@triton.jit
def _tile_filter_kernel(
    q_ptr, table_ptr, lens_ptr, lo_ptr, sc_ptr, rad_ptr, codes_ptr, t_ptr, ref_ptr, zlb_ptr,
    slot_ptr, pos_ptr, lvl_ptr, total_ptr, tcount_ptr, tstat_ptr, tdrop_ptr, tmass_ptr, base_ptr,
    stride_qb, stride_qh, stride_tb, stride_ms, stride_mh, stride_cs, stride_ch, sigma, min_sparse, CAP,
    eps_budget, rounding,
    P: tl.constexpr, D: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, TP: tl.constexpr, BITS: tl.constexpr,
    SINK: tl.constexpr, RECENT: tl.constexpr, ATOMIC: tl.constexpr, POS_OUT: tl.constexpr,
    WINDOW: tl.constexpr, K: tl.constexpr, START: tl.constexpr,
    EDGE_LOW: tl.constexpr, EDGE_STEP: tl.constexpr, EDGE_COUNT: tl.constexpr,
):
    R: tl.constexpr = TP * GP
    N: tl.constexpr = TP * P
    b = tl.program_id(0)
    h = tl.program_id(1)
    tile = tl.program_id(2)
    n_heads_kv = tl.num_programs(1)
    n_tiles = tl.num_programs(2)
    row = b * n_heads_kv + h
    seq_len = tl.load(lens_ptr + b).to(tl.int64)
    pages, first, end = request_layout(seq_len, P, SINK, RECENT, min_sparse)
    j = tl.arange(0, TP)
    p_j = first + tile * TP + j
    page_ok = p_j < end
    page = tl.load(table_ptr + b * stride_tb + p_j, mask=page_ok, other=0).to(tl.int64)  # [TP]
    g = tl.arange(0, GP)
    # rows r = (page j, head g), page-major
    page_r = tl.reshape(tl.broadcast_to(page[:, None], (TP, GP)), (R,))
    ok_r = tl.reshape(page_ok[:, None] & (g < G)[None, :], (R,))
    g_r = tl.reshape(tl.broadcast_to(g[None, :], (TP, GP)), (R,))
    head_row = b * n_heads_kv * G + h * G + g_r  # flat (request, query head), valid where g < G
    dim = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + (h * G + g_r)[:, None] * stride_qh + dim[None, :], mask=ok_r[:, None],
                other=0.0).to(tl.float32)
    meta = page_r[:, None] * stride_ms + h * stride_mh + dim[None, :]
    lo = tl.load(lo_ptr + meta, mask=ok_r[:, None], other=0.0).to(tl.float32)
    sc = tl.load(sc_ptr + meta, mask=ok_r[:, None], other=0.0).to(tl.float32)
    rad = tl.load(rad_ptr + meta, mask=ok_r[:, None], other=0.0).to(tl.float32)
    w, offset, pb, _ = page_terms_and_slack(q, lo, sc, rad, D, BITS)
    ref = tl.load(ref_ptr + head_row, mask=ok_r, other=0.0)
    if WINDOW:  # the gate: the window's lowest edge, just above it (units below it count at every edge)
        z_lb = tl.load(zlb_ptr + head_row, mask=ok_r, other=0.0)
        n_idx = (end - first) * P
        base = _window_base(z_lb, n_idx, eps_budget, rounding, sigma, EDGE_LOW, EDGE_STEP, EDGE_COUNT, START)
        e_lo = EDGE_LOW + EDGE_STEP * base.to(tl.float64)
        # the window threshold reads the base from here (it must be this very value)
        tl.store(base_ptr + row * GP + g_r, base, mask=(tile == 0) & (tl.arange(0, R) < GP))
        t = (ref.to(tl.float64) + e_lo / sigma).to(tl.float32)  # a gate only: the masses decide by x
    else:
        t = tl.load(t_ptr + head_row, mask=ok_r, other=float("inf"))
    t = tl.where(ok_r, t, float("inf"))
    x_page = sigma * (pb - ref)  # fp32, as every token's x below: the window compares these
    if WINDOW:
        keep_page = ((x_page.to(tl.float64) >= e_lo) | (pb != pb)) & ok_r
    else:
        keep_page = ((pb >= t) | (pb != pb)) & ok_r
    skip = ok_r & (keep_page == 0)
    wq, step, err = quantize_weights(w, BITS)
    # the tile's tokens: codes of pages some head keeps (a skipped page reads none)
    read_j = tl.max(_per_page(keep_page.to(tl.int32), TP, GP), 1) > 0  # [TP]
    tok = tl.arange(0, P)
    slots2 = page[:, None] * P + tok[None, :]  # [TP, P]
    valid2 = page_ok[:, None] & (tok[None, :] >= 0)
    slots = tl.reshape(slots2, (N,))
    read_n = tl.reshape(read_j[:, None] & (tok[None, :] >= 0), (N,))
    per_byte: tl.constexpr = 8 // BITS
    byte = tl.load(codes_ptr + slots[:, None] * stride_cs + h * stride_ch + (dim // per_byte)[None, :],
                   mask=read_n[:, None], other=0)
    code_mask: tl.constexpr = (1 << BITS) - 1
    codes = ((byte.to(tl.int32) >> ((dim % per_byte) * BITS)[None, :]) & code_mask).to(tl.float16)
    acc = tl.dot(wq, tl.trans(codes), out_dtype=tl.float32)  # [R, N] exact integers
    u_all = offset[:, None] + step[:, None] * acc + err[:, None]
    u = _diagonal(u_all, TP, GP, P)  # [TP, GP, P]
    pb3 = _per_page(pb, TP, GP)[:, :, None]
    t3 = _per_page(t, TP, GP)[:, :, None]
    ref3 = _per_page(ref, TP, GP)[:, :, None]
    cand = (_per_page(keep_page.to(tl.int32), TP, GP) > 0)[:, :, None] & valid2[:, None, :]
    u = tl.minimum(u, pb3)  # a token's bound is at most its page's (NaN stays NaN)
    x_tok = sigma * (u - ref3)
    if WINDOW:
        keep = cand & ((x_tok.to(tl.float64) >= e_lo_3(e_lo, TP, GP)) | (u != u))
    else:
        keep = cand & ((u >= t3) | (u != u))
    lost = cand & (keep == 0)
    # dropped mass per (page, head): skipped pages whole, lost tokens by their bounds
    page_mass = tl.where(skip, P * tl.exp(x_page), 0.0)
    tok_mass = tl.sum(tl.where(lost, tl.exp(x_tok), 0.0), 2)  # [TP, GP]
    dropped = tl.sum(_per_page(page_mass, TP, GP) + tok_mass, 0).to(tl.float64) * MASS_UP  # [GP]
    skipped = tl.sum(_per_page(skip.to(tl.int32), TP, GP), 0)  # [GP]
    surv2 = tl.max(keep.to(tl.int32), 1) > 0  # [TP, P]: the GQA union
    surv = tl.reshape(surv2, (N,))
    found = tl.sum(surv.to(tl.int32), 0)
    local = tl.cumsum(surv.to(tl.int32), 0) - 1
    if ATOMIC:
        start = tl.atomic_add(total_ptr + row, found, sem="relaxed")
    else:
        start = tile * N
    dest = row.to(tl.int64) * CAP + start + local
    tl.store(slot_ptr + dest, slots.to(tl.int32), mask=surv)
    if POS_OUT:
        pos = tl.reshape(p_j[:, None] * P + tok[None, :], (N,))
        tl.store(pos_ptr + dest, pos.to(tl.int32), mask=surv)
    stat_row = row * n_tiles + tile
    tl.store(tcount_ptr + stat_row, found)
    tl.store(tstat_ptr + stat_row * (GP + 1) + g, skipped)
    tl.store(tstat_ptr + stat_row * (GP + 1) + GP, tl.sum(read_j.to(tl.int32), 0))
    tl.store(tdrop_ptr + stat_row * GP + g, dropped)
    if WINDOW:
        # per head and window edge k: the mass of the units below edge (base + k). The edges are
        # multiples of 1/4 below 64 in magnitude, exact in fp32, so comparing fp32 x with them is
        # exact, the same comparison the levels below make
        k = tl.arange(0, K)
        e_lo2 = tl.reshape(e_lo, (TP, GP)).to(tl.float32)
        page_x = _per_page(x_page, TP, GP)
        page_units = tl.where(_per_page(ok_r, TP, GP), P * tl.exp(page_x), 0.0)
        mass_tok = tl.where(valid2[:, None, :] & (x_tok == x_tok), tl.exp(x_tok), 0.0)
        window = tl.zeros((GP, K), tl.float32)
        for kk in tl.static_range(K):
            edge2 = e_lo2 + EDGE_STEP * kk  # [TP, GP]
            tok_part = tl.sum(tl.where(x_tok < edge2[:, :, None], mass_tok, 0.0), 2)
            units = tl.where(page_x < edge2, page_units, tok_part)
            window += tl.where(k[None, :] == kk, tl.sum(units, 0)[:, None], 0.0)
        tl.store(tmass_ptr + (stat_row * GP + g[:, None]) * K + k[None, :], window.to(tl.float64) * MASS_UP)
        # per survivor and head: how many window edges its bound reaches (0..K)
        x_rel = (x_tok.to(tl.float64) - e_lo_3(e_lo, TP, GP)) / EDGE_STEP
        lvl = tl.where(x_tok == x_tok, tl.floor(x_rel) + 1.0, K * 1.0)
        lvl = tl.minimum(tl.maximum(lvl, 0.0), K * 1.0).to(tl.int32)
        lvl = tl.where(cand, lvl, 0)
        lvl_n = tl.reshape(tl.permute(lvl, (0, 2, 1)), (N, GP))  # [N, GP]
        tl.store(lvl_ptr + dest[:, None] * GP + g[None, :], lvl_n.to(tl.uint8), mask=surv[:, None])


@triton.jit
def e_lo_3(e_lo, TP: tl.constexpr, GP: tl.constexpr):
    """The window's lowest edge value (fp64) per row as ``[TP, GP, 1]``."""
    return tl.reshape(e_lo, (TP, GP))[:, :, None]


@triton.jit
def _compact_kernel(slot_ptr, pos_ptr, lvl_ptr, out_slot_ptr, out_pos_ptr, out_lvl_ptr, tcount_ptr, offset_ptr,
                    CAP, N: tl.constexpr, GP: tl.constexpr, POS_OUT: tl.constexpr, LEVELS: tl.constexpr):
    """One tile's survivors from its own region to their place in the row's list (the exclusive
    prefix sum of the tiles' counts)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    tile = tl.program_id(2)
    row = b * tl.num_programs(1) + h
    stat_row = row * tl.num_programs(2) + tile
    count = tl.load(tcount_ptr + stat_row)
    start = tl.load(offset_ptr + stat_row) - count  # offsets are inclusive sums
    i = tl.arange(0, N)
    live = i < count
    src = row.to(tl.int64) * CAP + tile * N + i
    dst = row.to(tl.int64) * CAP + start + i
    tl.store(out_slot_ptr + dst, tl.load(slot_ptr + src, mask=live, other=0), mask=live)
    if POS_OUT:
        tl.store(out_pos_ptr + dst, tl.load(pos_ptr + src, mask=live, other=0), mask=live)
    if LEVELS:
        g = tl.arange(0, GP)
        lv = tl.load(lvl_ptr + src[:, None] * GP + g[None, :], mask=live[:, None], other=0)
        tl.store(out_lvl_ptr + dst[:, None] * GP + g[None, :], lv, mask=live[:, None])


@triton.jit
def _round_up_to_f32(t):
    """fp64 ``t`` to fp32, rounding towards +inf."""
    y = t.to(tl.float32)
    bits = y.to(tl.int32, bitcast=True)
    up = tl.where(y > 0, bits + 1, tl.where(y < 0, bits - 1, 1))
    return tl.where(y.to(tl.float64) < t, up.to(tl.float32, bitcast=True), y)


@triton.jit
def _window_threshold_kernel(
    tmass_ptr, base_ptr, lens_ptr, ref_ptr, zlb_ptr, t_ptr, cert_ptr, kstar_ptr, flag_ptr, sigma, min_sparse,
    eps_budget, rounding, NT, P: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
    K: tl.constexpr, BLOCK_T: tl.constexpr, EDGE_LOW: tl.constexpr, EDGE_STEP: tl.constexpr,
    EDGE_COUNT: tl.constexpr, EDGE_MARGIN: tl.constexpr,
):
    """Per (request, KV head): the window masses summed over the tiles, the highest edge whose
    mass (times 1 + rounding) fits eps·Z_lb, T placed just above it (rounded up to fp32, so every
    unit below the edge is below T), its certificate; a request whose lowest window edge does not
    fit is flagged for dense attention."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b * tl.num_programs(1) + h
    g = tl.arange(0, GP)
    gmask = g < G
    head_row = b * tl.num_programs(1) * G + h * G + g
    seq_len = tl.load(lens_ptr + b).to(tl.int64)
    pages, first, end = request_layout(seq_len, P, SINK, RECENT, min_sparse)
    k = tl.arange(0, K)
    mass = tl.zeros((GP, K), tl.float64)
    for t0 in range(0, NT, BLOCK_T):
        ti = t0 + tl.arange(0, BLOCK_T)
        part = tl.load(tmass_ptr + ((row * NT + ti)[:, None, None] * GP + g[None, :, None]) * K + k[None, None, :],
                       mask=(ti < NT)[:, None, None], other=0.0)
        mass += tl.sum(part, 0)
    ref = tl.load(ref_ptr + head_row, mask=gmask, other=0.0)
    z_lb = tl.load(zlb_ptr + head_row, mask=gmask, other=0.0)
    base = tl.load(base_ptr + row * GP + g)  # the filter's window base
    bound = mass * (1.0 + rounding)
    exists = (base[:, None] + k[None, :]) < EDGE_COUNT
    fits = (bound <= (eps_budget * z_lb)[:, None]) & exists
    kstar = tl.max(tl.where(fits, k[None, :], -1), 1)
    cert = tl.sum(tl.where(k[None, :] == kstar[:, None], bound, 0.0), 1)
    indexed = end > first
    edge = EDGE_LOW + EDGE_STEP * (base + kstar).to(tl.float64)
    t = _round_up_to_f32(ref.to(tl.float64) + (edge + EDGE_MARGIN) / sigma)
    failed = gmask & indexed & (kstar < 0)
    t = tl.where(indexed, t, float("-inf"))
    t = tl.where(failed | (ref != ref) | (tl.abs(ref) == float("inf")), float("-inf"), t)
    tl.store(t_ptr + head_row, t, mask=gmask)
    tl.store(cert_ptr + head_row, tl.where(indexed & (kstar >= 0), cert, 0.0), mask=gmask)
    tl.store(kstar_ptr + row * GP + g, tl.where(indexed, kstar, -1))
    tl.atomic_max(flag_ptr + b, tl.max(failed.to(tl.int32), 0) * 2, sem="relaxed")


@triton.jit
def _tiled_attend_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, slot_ptr, pos_ptr, lvl_ptr, total_ptr, kstar_ptr, t_ptr, ref_ptr,
    flag_ptr, m_ptr, l_ptr, o_ptr, zown_ptr, count_ptr, mass_ptr, keep_ptr,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tb, stride_kb, sigma, min_sparse, CAP,
    P: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BG: tl.constexpr,
    SINK: tl.constexpr, RECENT: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr,
    QHI: tl.constexpr, PV: tl.constexpr, GATE: tl.constexpr, GATE_REL: tl.constexpr, LEVELS: tl.constexpr,
    KEEP_OUT: tl.constexpr, ALL_DENSE: tl.constexpr, FLAGGED_ONLY: tl.constexpr,
):
    # flag 1: the request's union exceeded the fallback fraction before the attention (budget,
    # fixed, dense); 2: its certified level lay below the window, or (certified) the keys the first
    # launch read exceeded the fraction. Both are attended densely: in the first launch (flag 1),
    # or by the second launch (FLAGGED_ONLY: flag 2; every other program writes nothing).
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    n_heads_kv = tl.num_programs(1)
    S = tl.num_programs(2)
    row = b * n_heads_kv + h
    seq_len = tl.load(lens_ptr + b).to(tl.int64)
    pages, first, end = request_layout(seq_len, P, SINK, RECENT, min_sparse)
    flag = tl.load(flag_ptr + b)
    if FLAGGED_ONLY:
        runs = flag == 2
        dense = runs
    elif ALL_DENSE:
        runs = flag != 2
        dense = flag >= 0
    else:
        runs = flag != 2
        dense = flag == 1
    n_sink_tok = first * P
    n_dense = n_sink_tok + seq_len - end * P
    count = tl.load(total_ptr + row).to(tl.int64)
    total = tl.where(dense, seq_len, n_dense + count)
    total = tl.where(runs, total, 0)
    chunk = tl.maximum(tl.cdiv(total, S), MIN_CHUNK)
    chunk = tl.cdiv(chunk, BLOCK_N) * BLOCK_N
    start = s * chunk
    stop = tl.minimum(start + chunk, total)
    g, gmask, head_row, q = group_queries(q_ptr, b, h, stride_qb, stride_qh, G, BG, D)
    t = tl.load(t_ptr + head_row, mask=gmask, other=float("inf"))
    if GATE:
        gate_t = t - GATE_REL * (tl.abs(t) + 1.0)
    else:
        gate_t = tl.full((BG,), float("-inf"), tl.float32)
    if LEVELS:  # a row is attended where some head's bound reaches that head's chosen edge
        kstar = tl.load(kstar_ptr + row * GP + g, mask=gmask, other=2147483647)
    ref = tl.load(ref_ptr + head_row, mask=gmask, other=0.0)
    q_norm = query_norms(q)
    dim = tl.arange(0, D)
    dv = tl.arange(0, DV)
    m_i = tl.full((BG,), float("-inf"), tl.float32)
    l_i = tl.zeros((BG,), tl.float32)
    acc = tl.zeros((BG, DV), tl.float32)
    n_att = tl.zeros((BG,), tl.int32)
    n_values = 0
    n_keys = 0
    gated = tl.zeros((BG,), tl.float64)
    z_own = tl.zeros((BG,), tl.float64)
    for i0 in range(start, stop, BLOCK_N):
        i = i0 + tl.arange(0, BLOCK_N)
        live = i < stop
        in_list = (i >= n_dense) & (dense == 0)
        pos = tl.where(dense, i, tl.where(i < n_sink_tok, i, end * P + (i - n_sink_tok)))
        page = tl.load(table_ptr + b * stride_tb + pos // P, mask=live & (in_list == 0), other=0).to(tl.int64)
        entry = row.to(tl.int64) * CAP + (i - n_dense)
        listed = tl.load(slot_ptr + entry, mask=live & in_list, other=0).to(tl.int64)
        slots = tl.where(in_list, listed, page * P + pos % P)
        rows = live
        if LEVELS:
            lvl = tl.load(lvl_ptr + entry[:, None] * GP + g[None, :], mask=(live & in_list)[:, None] & gmask[None, :],
                          other=0).to(tl.int32)
            reach = tl.max((lvl > kstar[None, :]).to(tl.int32), 1) > 0
            rows = live & (reach | (in_list == 0))
        keys = tl.load(k_ptr + slots[:, None] * stride_ks + h * stride_kh + dim[None, :], mask=rows[:, None], other=0.0)
        sc = exact_scores(keys, q, QHI)
        keep = rows[:, None] & gmask[None, :]
        row_gate = tl.where(in_list[:, None], gate_t[None, :], float("-inf"))
        att = keep & ((sc >= row_gate) | (sc != sc))  # a NaN score is never below the gate
        sc_err = score_errors(keys, q_norm, D)
        gated += raised_mass(sc, sc_err, ref, keep & (att == 0), sigma)
        z_own += lowered_mass(sc, sc_err, ref, att, sigma)
        x = tl.where(att, sigma * sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(x, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        prob = tl.exp(x - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(prob, 0)
        vrow = tl.max(att.to(tl.int32), 1) > 0  # values only where some head attends
        vals = tl.load(v_ptr + slots[:, None] * stride_vs + h * stride_vh + dv[None, :], mask=vrow[:, None], other=0.0)
        if PV == tl.float32:
            acc = acc * alpha[:, None] + tl.dot(tl.trans(prob), vals, input_precision="ieee")
        else:
            acc = tl.dot(tl.trans(prob).to(PV), vals, acc=acc * alpha[:, None], out_dtype=tl.float32)
        m_i = m_new
        indexed = in_list | (dense & (pos >= n_sink_tok) & (pos < end * P))
        n_att += tl.sum((att & indexed[:, None]).to(tl.int32), 0)
        n_values += tl.sum((vrow & indexed).to(tl.int32), 0)
        n_keys += tl.sum((rows & indexed).to(tl.int32), 0)
        if KEEP_OUT:
            at = tl.where(in_list, tl.load(pos_ptr + entry, mask=live & in_list, other=0).to(tl.int64), pos)
            tl.store(keep_ptr + head_row[None, :] * stride_kb + at[:, None], att.to(tl.int8), mask=keep)
    split_row = row * S + s
    tl.store(m_ptr + split_row * BG + g, m_i, mask=runs)
    tl.store(l_ptr + split_row * BG + g, l_i, mask=runs)
    tl.store(o_ptr + (split_row * BG + g[:, None]) * DV + dv[None, :], acc, mask=runs)
    tl.store(zown_ptr + split_row * BG + g, z_own, mask=runs)
    counts = count_ptr + split_row * 3 * BG + g
    tl.store(counts, n_att, mask=runs)
    tl.store(counts + BG, tl.where(g == 0, n_values, 0), mask=runs)
    tl.store(counts + 2 * BG, tl.where(g == 0, n_keys, 0), mask=runs)
    tl.store(mass_ptr + split_row * BG + g, round_up_f32(gated), mask=runs)


# ----------------------------------------------------------------------------- host wrappers


def tile_shape(groups: int, page_size: int, launch: TritonLaunch) -> tuple[int, int]:
    """(GP, TP): the GQA group padded to a power of two, and the pages of one filter tile (so
    that the tile's TP·GP rows fill the tensor cores' 16: ``launch.tile_pages``, at least 16/GP)."""
    gp = triton.next_power_of_2(groups)
    return gp, max(launch.tile_pages, max(1, 16 // gp))


def num_tiles(max_pages: int, groups: int, page_size: int, launch: TritonLaunch) -> int:
    """Filter tiles of a page table ``max_pages`` wide."""
    return triton.cdiv(max_pages, tile_shape(groups, page_size, launch)[1])


def tile_filter(q, page_table, seq_lens, index: dict, threshold, ref, z_lb, lists: dict, stats: dict, sigma: float,
                layout: dict, min_sparse: int, bits: int, edges, launch: TritonLaunch, window=None,
                positions: bool = False) -> None:
    """The filter pass (module docstring).

    Args:
        q ``[B, H_q, D]``; page_table ``[B, W]``; seq_lens ``[B]``; index: the grid tensors
            (``grid_decode.certified_hist``); threshold, ref ``[B, H_q]`` fp32 (T is read unless
            ``window``); z_lb ``[B, H_q]`` fp64 (read with ``window``).
        lists: ``slot`` ``[B, H_kv, C]`` int32 (and ``pos`` with ``positions``, ``level``
            ``[B, H_kv, C, GP]`` uint8 with ``window``) out; ``total`` ``[B·H_kv]`` int32: with
            ``launch.tile_atomic`` the running count (zeroed by the caller), else unused.
            C >= NT·TP·P.
        stats: ``count`` ``[B, H_kv, NT]`` int32, ``pages`` ``[B, H_kv, NT, GP + 1]`` int32
            (skipped pages per head, pages read), ``dropped`` ``[B, H_kv, NT, GP]`` fp64 (upper
            bounds) and with ``window`` ``window`` ``[B, H_kv, NT, GP, K]`` fp64 and ``base``
            ``[B, H_kv, GP]`` int32 (the window's lowest edge index per head) out.
        window: None, or (eps_budget, rounding) of the certified histogram rule evaluated over
            ``launch.window_edges`` edges from the safe level's edge plus ``launch.window_start``.
        edges: the threshold edges (``contract.ThresholdEdges``).
    """
    batch, heads, dim = q.shape
    lo = index["lo"]
    h_kv = lo.shape[1]
    groups = heads // h_kv
    gp, tp = tile_shape(groups, layout["P"], launch)
    counts = stats["count"]
    slot = lists["slot"]
    grid = (batch, h_kv, counts.shape[2])
    eps_budget, rounding = window if window is not None else (0.0, 0.0)
    _tile_filter_kernel[grid](
        q, page_table, seq_lens, lo, index["scale"], index["radius"], index["codes"], threshold, ref, z_lb,
        slot, lists["pos"] if positions else slot, lists["level"] if window is not None else slot, lists["total"],
        counts, stats["pages"], stats["dropped"], stats["window"] if window is not None else stats["dropped"],
        stats["base"] if window is not None else counts,
        q.stride(0), q.stride(1), page_table.stride(0), lo.stride(0), lo.stride(1), index["codes"].stride(0),
        index["codes"].stride(1), float(sigma), int(min_sparse), slot.shape[2], float(eps_budget), float(rounding),
        **layout, D=dim, G=groups, GP=gp, TP=tp, BITS=bits, ATOMIC=bool(launch.tile_atomic), POS_OUT=positions,
        WINDOW=window is not None, K=launch.window_edges, START=launch.window_start,
        EDGE_LOW=float(edges.low), EDGE_STEP=float(edges.step), EDGE_COUNT=int(edges.count),
        num_warps=launch.tile_warps, num_stages=launch.tile_stages,
    )


def compact_lists(tile_lists: dict, lists: dict, counts, offsets, page_size: int, groups: int,
                  launch: TritonLaunch, positions: bool = False, levels: bool = False) -> None:
    """Copy every tile's survivors from its own region of ``tile_lists`` to its place in
    ``lists`` (``offsets`` ``[B, H_kv, NT]`` int32: the inclusive prefix sums of ``counts``
    along the tiles)."""
    batch, h_kv, n_tiles = counts.shape
    gp, tp = tile_shape(groups, page_size, launch)
    src, dst = tile_lists["slot"], lists["slot"]
    _compact_kernel[(batch, h_kv, n_tiles)](
        src, tile_lists["pos"] if positions else src, tile_lists["level"] if levels else src,
        dst, lists["pos"] if positions else dst, lists["level"] if levels else dst, counts, offsets,
        src.shape[2], N=tp * page_size, GP=gp, POS_OUT=positions, LEVELS=levels, num_warps=launch.compact_warps,
    )


def window_threshold(window_mass, base, seq_lens, ref, z_lb, threshold, certificate, kstar, flags, sigma: float,
                     layout: dict, min_sparse: int, eps_budget: float, rounding: float, groups: int, edges,
                     launch: TritonLaunch) -> None:
    """T per head from the filter's window masses (module docstring).

    Args:
        window_mass: ``[B, H_kv, NT, GP, K]`` fp64 and base ``[B, H_kv, GP]`` int32 from
            ``tile_filter``; ref ``[B, H_q]`` fp32;
            z_lb ``[B, H_q]`` fp64. threshold ``[B, H_q]`` fp32 out; certificate ``[B, H_q]``
            fp64 out; kstar ``[B, H_kv, GP]`` int32 out: the chosen window edge per head (−1:
            none); flags ``[B]`` int32 in/out: 2 where a head's lowest window edge did not fit.
    """
    batch, h_kv, n_tiles, gp, k = window_mass.shape
    _window_threshold_kernel[(batch, h_kv)](
        window_mass, base, seq_lens, ref, z_lb, threshold, certificate, kstar, flags, float(sigma), int(min_sparse),
        float(eps_budget), float(rounding), n_tiles, **layout, G=groups, GP=gp, K=k, BLOCK_T=launch.merge_block, EDGE_LOW=float(edges.low), EDGE_STEP=float(edges.step),
        EDGE_COUNT=int(edges.count), EDGE_MARGIN=float(edges.margin), num_warps=launch.merge_warps,
    )


def tiled_attend(q, k_cache, v_cache, page_table, seq_lens, lists: dict, threshold, ref, flags, kstar, m, l, o, z_own,
                 counts, gated, sigma: float, layout: dict, min_sparse: int, gate: bool, gate_rel: float, pv_dtype,
                 launch: TritonLaunch, attended=None, all_dense: bool = False, flagged_only: bool = False) -> None:
    """Split-K attention over the dense rows and the (request, KV head) lists.

    Args:
        q ``[B, H_q, D]``; k_cache ``[slots, H_kv, D]``; v_cache ``[slots, H_kv, D_v]``;
        page_table ``[B, W]``; seq_lens ``[B]``.
        lists: ``slot`` ``[B, H_kv, C]`` int32, ``total`` ``[B·H_kv]`` int32 (rows per list),
            ``level`` ``[B, H_kv, C, GP]`` uint8 where ``kstar`` is given, ``pos`` with ``attended``.
        threshold, ref ``[B, H_q]`` fp32; flags ``[B]`` int32 (1, 2: dense, see the kernel).
        kstar: optional ``[B, H_kv, GP]`` int32: the certified window edge per head.
        m, l ``[B, H_kv, S, BG]`` fp32, o ``[B, H_kv, S, BG, D_v]`` fp32, z_own ``[B, H_kv, S, BG]``
            fp64 out: ``grid_decode.attend``'s split state; counts ``[B, H_kv, S, 3, BG]`` int32
            out (indexed rows attended per head; V rows and K rows of indexed keys read); gated
            ``[B, H_kv, S, BG]`` fp32 out (value-gated mass, an upper bound).
        gate: budget and fixed policies: indexed rows scoring below T − gate_rel·(|T| + 1) skip V.
        attended: optional ``[B, H_q, W·P]`` int8 out (callers zero it).
        all_dense: every request attends densely (the dense policy). flagged_only: the second
            launch: only requests flagged 2.
    S = ``m.shape[2]``; BG = ``grid_decode.block_g``.
    """
    batch, heads, dim = q.shape
    h_kv, d_v = k_cache.shape[1], v_cache.shape[2]
    groups = heads // h_kv
    splits, bg = m.shape[2], m.shape[3]
    slot = lists["slot"]
    levels = kstar is not None
    _tiled_attend_kernel[(batch, h_kv, splits)](
        q, k_cache, v_cache, page_table, seq_lens, slot, lists["pos"] if attended is not None else slot,
        lists["level"] if levels else slot, lists["total"], kstar if levels else lists["total"], threshold, ref, flags,
        m, l, o, z_own, counts, gated, attended if attended is not None else counts,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        page_table.stride(0), attended.stride(1) if attended is not None else 0, float(sigma), int(min_sparse),
        slot.shape[2], **layout, D=dim, DV=d_v, G=groups, GP=triton.next_power_of_2(groups), BG=bg,
        BLOCK_N=launch.list_block, MIN_CHUNK=launch.list_min_rows, QHI=pv_dtype, PV=pv_dtype, GATE=gate,
        GATE_REL=float(gate_rel), LEVELS=levels, KEEP_OUT=attended is not None, ALL_DENSE=all_dense,
        FLAGGED_ONLY=flagged_only, num_warps=launch.list_warps, num_stages=launch.list_stages,
    )
