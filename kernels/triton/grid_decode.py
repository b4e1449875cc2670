"""Decode kernels of the GPU path (grid family). Specification: ``louver_sgl.decode.reference``.

Every kernel reads the page table and sequence lengths on the device (no host planning, no host
synchronisation), so one step can be captured in a CUDA graph for a fixed batch size and page
table width. A request with L tokens has pages [0, ceil(L/P)); sink pages, recent pages and the
partial tail page are attended densely, the other full pages through the index.

* ``exact_part``: exact scores of the dense part and of an evenly spaced sample of indexed tokens:
  the reference score ref (their max), Z_lb (a lower bound of Σ exp(σ·(s − ref)), fp64) and the
  sample scores (budget quantile).
* ``certified_hist``: per (request, query head) histogram over the threshold edges of the mass
  dropped at each edge (pages below it whole, tokens below it in the other pages), plus the
  histogram of absolute terms that bounds its fp64 rounding.
* ``attend``: per (request, KV head, split of pages) page bounds, token bounds, the GQA-union
  candidate gate, exact scores from candidate keys, the optional value gate and an online softmax
  over candidates and dense rows with V read only for attended rows; writes the split's softmax
  state and counters. Splits are merged in ``louver_sgl.decode.impl_triton``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .grid_bounds import (
    MASS_UP, exact_scores, group_queries, load_codes, load_page_terms, load_page_terms_and_slack, lowered_mass,
    order_envelopes, query_norms, quantize_weights, raised_mass, request_layout, round_up_f32, score_errors, scores_and_union_mass,
    scores_with_lower_bounds, token_bounds,
)
from .launch import TritonLaunch

# The request layout, the threshold edges and the value gate's margin are the caller's data
# (``louver_sgl.decode.contract``), passed to every kernel as constexprs (``RequestLayout.constexprs``,
# ``edge_args``) rather than written here a second time.
HIST_TILE = tl.constexpr(512)  # histogram bins one tile holds: edge count + 2 must fit


@triton.jit
def _online_mass(m, z, s, s_lb, valid, sigma):
    """Fold scores ``[T, BG]`` into the running max m (fp32) and Z = Σ exp(σ·(s_lb − m)) (fp64)."""
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 0))
    ref = tl.where(m_new == float("-inf"), 0.0, m_new).to(tl.float64)
    z = z * tl.exp(sigma * (m.to(tl.float64) - ref))
    z += tl.sum(tl.where(valid, tl.exp(sigma * (s_lb.to(tl.float64) - ref[None, :])), 0.0), 0)
    return m_new, z


@triton.jit
def _exact_part_kernel(
    q_ptr, k_ptr, table_ptr, lens_ptr, ref_ptr, zlb_ptr, sample_ptr, t_ptr, hist_ptr, habs_ptr,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_tb, sigma, budget, min_sparse, sum_down,
    P: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BG: tl.constexpr,
    SINK: tl.constexpr, RECENT: tl.constexpr, M: tl.constexpr, MP: tl.constexpr,
    BLOCK_T: tl.constexpr, QHI: tl.constexpr, BUDGET: tl.constexpr, ZERO_HIST: tl.constexpr,
    HIST_WIDTH: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b).to(tl.int64)
    pages, first, end = request_layout(seq_len, P, SINK, RECENT, min_sparse)
    n_sink_tok = first * P
    n_dense = n_sink_tok + seq_len - end * P
    n_idx = (end - first) * P
    count = tl.minimum(n_idx, M)
    g, gmask, head_row, q = group_queries(q_ptr, b, h, stride_qb, stride_qh, G, BG, D)
    dim = tl.arange(0, D)
    m = tl.full((BG,), float("-inf"), tl.float32)
    z = tl.zeros((BG,), tl.float64)
    for start in range(0, n_dense, BLOCK_T):  # sink pages, recent pages and the tail
        i = start + tl.arange(0, BLOCK_T)
        valid = i < n_dense
        pos = tl.where(i < n_sink_tok, i, end * P + (i - n_sink_tok))
        page = tl.load(table_ptr + b * stride_tb + pos // P, mask=valid, other=0).to(tl.int64)
        keys = tl.load(k_ptr + (page * P + pos % P)[:, None] * stride_ks + h * stride_kh + dim[None, :],
                       mask=valid[:, None], other=0.0)
        s, s_lb = scores_with_lower_bounds(keys, q, QHI, D)
        m, z = _online_mass(m, z, s, s_lb, valid[:, None], sigma)
    j = tl.arange(0, MP)  # the sample: M evenly spaced indexed tokens, one tile
    in_sample = j < count
    spaced = tl.where(n_idx > M, j.to(tl.int64) * n_idx // M, j)
    pos = first * P + spaced
    page = tl.load(table_ptr + b * stride_tb + pos // P, mask=in_sample, other=0).to(tl.int64)
    keys = tl.load(k_ptr + (page * P + pos % P)[:, None] * stride_ks + h * stride_kh + dim[None, :],
                   mask=in_sample[:, None], other=0.0)
    s, s_lb = scores_with_lower_bounds(keys, q, QHI, D)
    m, z = _online_mass(m, z, s, s_lb, in_sample[:, None], sigma)
    s = tl.where(in_sample[:, None], s, float("-inf"))
    tl.store(sample_ptr + head_row[None, :] * M + j[:, None], s, mask=(j < M)[:, None] & gmask[None, :])
    tl.store(ref_ptr + head_row, m, mask=gmask)
    tl.store(zlb_ptr + head_row, z * sum_down, mask=gmask)  # covers the fp64 rounding
    if BUDGET:  # T = the max(1, floor(f·count))-th largest sample score
        # remove the k − 1 largest (one instance each, so ties count), then take the max:
        # k <= f·M passes over the tile are much cheaper than a sort
        work = tl.trans(s)  # [BG, MP]
        k = tl.maximum(tl.floor(count.to(tl.float64) * budget), 1.0).to(tl.int32)
        for _ in range(1, k):
            top = tl.argmax(work, 1)
            work = tl.where(j[None, :] == top[:, None], float("-inf"), work)
        t = tl.max(work, 1)
        t = tl.where(count > 0, t, float("-inf"))
        tl.store(t_ptr + head_row, t, mask=gmask)
    if ZERO_HIST:
        e = tl.arange(0, HIST_TILE)
        rows = head_row[:, None] * HIST_WIDTH + e[None, :]
        zero_mask = gmask[:, None] & (e < HIST_WIDTH)[None, :]
        tl.store(hist_ptr + rows, tl.zeros((BG, HIST_TILE), tl.float64), mask=zero_mask)
        tl.store(habs_ptr + rows, tl.zeros((BG, HIST_TILE), tl.float64), mask=zero_mask)


@triton.jit
def _round_down_f32(t):
    """fp64 ``t`` to fp32, rounding towards −inf."""
    y = t.to(tl.float32)
    bits = y.to(tl.int32, bitcast=True)
    down = tl.where(y > 0, bits - 1, tl.where(y < 0, bits + 1, -2147483647))
    return tl.where(y.to(tl.float64) > t, down.to(tl.float32, bitcast=True), y)


@triton.jit
def _certified_threshold_kernel(
    hist_ptr, habs_ptr, ref_ptr, zlb_ptr, t_ptr, cert_ptr, sigma, eps_budget, rounding,
    G: tl.constexpr, BG: tl.constexpr, EDGE_LOW: tl.constexpr, EDGE_STEP: tl.constexpr,
    EDGE_COUNT: tl.constexpr, EDGE_MARGIN: tl.constexpr, HIST_WIDTH: tl.constexpr,
):
    """T per head: the largest edge whose certified dropped mass fits eps·Z_lb."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = tl.arange(0, BG)
    gmask = g < G
    head_row = b * tl.num_programs(1) * G + h * G + g
    e = tl.arange(0, HIST_TILE)
    rows = head_row[:, None] * HIST_WIDTH + e[None, :]
    emask = gmask[:, None] & (e < HIST_WIDTH)[None, :]
    hist = tl.load(hist_ptr + rows, mask=emask, other=0.0)
    habs = tl.load(habs_ptr + rows, mask=emask, other=0.0)
    bound = tl.cumsum(hist, 1) + rounding * tl.cumsum(habs, 1)
    z_lb = tl.load(zlb_ptr + head_row, mask=gmask, other=0.0)
    ok = (bound <= (eps_budget * z_lb)[:, None]) & (e < EDGE_COUNT)[None, :]
    edge = tl.max(tl.where(ok, e[None, :], -1), 1)
    cert = tl.sum(tl.where(e[None, :] == edge[:, None], bound, 0.0), 1)
    ref = tl.load(ref_ptr + head_row, mask=gmask, other=0.0)
    t64 = ref.to(tl.float64) + (EDGE_LOW + EDGE_STEP * edge.to(tl.float64) - EDGE_MARGIN) / sigma
    t = _round_down_f32(t64)
    t = tl.where((edge < 0) | (tl.abs(ref) == float("inf")) | (ref != ref), float("-inf"), t)
    tl.store(t_ptr + head_row, t, mask=gmask)
    tl.store(cert_ptr + head_row, tl.where(edge < 0, 0.0, cert), mask=gmask)


@triton.jit
def _edge_bin(x, EDGE_LOW: tl.constexpr, EDGE_STEP: tl.constexpr, EDGE_COUNT: tl.constexpr):
    """Number of threshold edges <= x (fp64); NaN maps past the last edge."""
    b = tl.floor((x - EDGE_LOW) / EDGE_STEP) + 1.0
    b = tl.minimum(tl.maximum(b, 0.0), EDGE_COUNT * 1.0)
    return tl.where(x == x, b, EDGE_COUNT * 1.0).to(tl.int32)


@triton.jit
def _certified_hist_kernel(
    q_ptr, table_ptr, lens_ptr, lo_ptr, sc_ptr, rad_ptr, codes_ptr, ref_ptr, hist_ptr, habs_ptr, flag_ptr,
    stride_qb, stride_qh, stride_tb, stride_ms, stride_mh, stride_cs, stride_ch, sigma, min_sparse,
    P: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, BITS: tl.constexpr,
    SINK: tl.constexpr, RECENT: tl.constexpr, SPLIT, EDGE_LOW: tl.constexpr, EDGE_STEP: tl.constexpr,
    EDGE_COUNT: tl.constexpr, HIST_WIDTH: tl.constexpr, FLAGGED: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b).to(tl.int64)
    pages, first, end = request_layout(seq_len, P, SINK, RECENT, min_sparse)
    if FLAGGED:  # only the flagged requests' pages (the one-pass rule's rare path)
        end = tl.where(tl.load(flag_ptr + b) != 0, end, first)
    g, gmask, head_row, q = group_queries(q_ptr, b, h, stride_qb, stride_qh, G, BG, D)
    ref = tl.load(ref_ptr + head_row, mask=gmask, other=0.0).to(tl.float64)
    base = head_row * HIST_WIDTH
    p0 = first + s * SPLIT
    for p in range(p0, tl.minimum(p0 + SPLIT, end)):
        page = tl.load(table_ptr + b * stride_tb + p).to(tl.int64)
        w, offset, pb, slack = load_page_terms_and_slack(lo_ptr, sc_ptr, rad_ptr, page, h, stride_ms, stride_mh, q,
                                                         D, BITS)
        wq, step, err = quantize_weights(w, BITS)
        slots = page * P + tl.arange(0, P)
        codes = load_codes(codes_ptr, slots, h, stride_cs, stride_ch, D, BITS, p < end)
        u = token_bounds(codes, wq, step, err, offset)
        u = tl.minimum(u, pb[None, :])
        # Each unit's mass is its bound's; its bin is that of its bound lowered by how far the
        # gate kernel's evaluation of the same bound can lie below this one (another kernel
        # sums in another order): every unit the gate drops at an edge is counted below it.
        d_tok, d_page = order_envelopes(u, pb, offset, err, slack, D)
        x_page = sigma * (pb.to(tl.float64) - ref)
        x_tok = sigma * (u.to(tl.float64) - ref[None, :])
        b_page = _edge_bin(sigma * ((pb - d_page).to(tl.float64) - ref), EDGE_LOW, EDGE_STEP, EDGE_COUNT)
        b_tok = _edge_bin(sigma * ((u - d_tok).to(tl.float64) - ref[None, :]), EDGE_LOW, EDGE_STEP, EDGE_COUNT)
        m_page = tl.where(x_page == x_page, P * tl.exp(tl.minimum(x_page, 700.0)), 0.0)
        below = (b_tok < b_page[None, :]) & (x_tok == x_tok)
        m_tok = tl.where(below, tl.exp(tl.minimum(x_tok, 700.0)), 0.0)
        tok_sum = tl.sum(m_tok, 0)
        tl.atomic_add(hist_ptr + base + b_page, m_page - tok_sum, mask=gmask)
        tl.atomic_add(habs_ptr + base + b_page, m_page + tok_sum, mask=gmask)
        tok_mask = below & gmask[None, :]
        tl.atomic_add(hist_ptr + base[None, :] + b_tok, m_tok, mask=tok_mask)
        tl.atomic_add(habs_ptr + base[None, :] + b_tok, m_tok, mask=tok_mask)


@triton.jit
def _attend_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, lo_ptr, sc_ptr, rad_ptr, codes_ptr,
    t_ptr, ref_ptr, m_ptr, l_ptr, o_ptr, count_ptr, mass_ptr, keep_ptr, flag_ptr, t0_ptr, zu_ptr, zown_ptr,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tb,
    stride_ms, stride_mh, stride_cs, stride_ch, stride_kb, sigma, SPLIT, min_sparse, band,
    P: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, G: tl.constexpr, BG: tl.constexpr,
    BITS: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr,
    QHI: tl.constexpr, PV: tl.constexpr, GATE: tl.constexpr, GATE_REL: tl.constexpr, KEEP_OUT: tl.constexpr,
    FALLBACK_PASS: tl.constexpr, Z_UNION: tl.constexpr,
):
    # Work is skipped where nothing survives: a skipped page reads no codes, a page without
    # candidates reads no keys, a key no head attends reads no value. The fallback pass runs
    # only the requests flagged in flag_ptr, densely (T = −inf), and leaves the counters alone.
    # Z_UNION: also the lower bound of every union row's softmax mass per head (zu_ptr, fp64; the
    # a-posteriori rule's Z_att). band (a runtime flag, so that the band pass runs the first
    # pass's very binary and its bounds are bit-identical): the a-posteriori band pass: only
    # indexed tokens kept at t_ptr's level and not at t0_ptr's (the first pass's T), so no key is
    # scored twice and none is missed; its union and value counts leave out rows the first pass read.
    # zown_ptr: per head the lower bound of its own attended rows' mass (scores lowered by their
    # rounding bound): the reported bound's denominator. Dropped and gated masses are upper bounds.
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    n_heads_kv = tl.num_programs(1)
    seq_len = tl.load(lens_ptr + b).to(tl.int64)
    pages, first, end = request_layout(seq_len, P, SINK, RECENT, min_sparse)
    g, gmask, head_row, q = group_queries(q_ptr, b, h, stride_qb, stride_qh, G, BG, D)
    dim = tl.arange(0, D)
    dv = tl.arange(0, DV)
    tok = tl.arange(0, P)
    if FALLBACK_PASS:
        runs = tl.load(flag_ptr + b) != 0
        pages = tl.where(runs, pages, 0)
        t = tl.full((BG,), float("-inf"), tl.float32)
    else:
        runs = pages >= 0
        t = tl.load(t_ptr + head_row, mask=gmask, other=float("inf"))
    in_band = band != 0
    t0 = tl.load(t0_ptr + head_row, mask=gmask, other=float("inf"))  # read only by the band pass
    pages = tl.where(in_band & (tl.min(t, 0) == float("inf")), 0, pages)  # band, no head lowered: no scan
    if GATE:  # candidates clearly below T skip their V read (budget and fixed policies)
        gate_t = t - GATE_REL * (tl.abs(t) + 1.0)
    else:
        gate_t = tl.full((BG,), float("-inf"), tl.float32)
    ref = tl.load(ref_ptr + head_row, mask=gmask, other=0.0)
    m_i = tl.full((BG,), float("-inf"), tl.float32)
    l_i = tl.zeros((BG,), tl.float32)
    acc = tl.zeros((BG, DV), tl.float32)
    n_att = tl.zeros((BG,), tl.int32)
    n_skip = tl.zeros((BG,), tl.int32)
    dropped = tl.zeros((BG,), tl.float64)
    gated = tl.zeros((BG,), tl.float64)
    n_union = tl.zeros((P,), tl.int32)
    n_values = tl.zeros((P,), tl.int32)
    n_read = tl.zeros((BG,), tl.int32)
    z_union = tl.zeros((BG,), tl.float64)
    z_own = tl.zeros((BG,), tl.float64)
    q_norm = query_norms(q)
    p0 = s * SPLIT
    for p in range(p0, tl.minimum(p0 + SPLIT, pages)):
        page = tl.load(table_ptr + b * stride_tb + p).to(tl.int64)
        slots = page * P + tok
        valid = (p * P + tok) < seq_len
        keep = valid[:, None] & gmask[None, :]  # dense rows: every valid token
        page_gate = tl.full((BG,), float("-inf"), tl.float32)
        is_idx = ((p >= first) & (p < end)).to(tl.int32)
        keep = keep & ((is_idx > 0) | (in_band == 0))  # the band: the first pass attended the dense rows
        row_first = tl.zeros((P,), tl.int32)  # band: rows some head kept at the first level
        if is_idx > 0:  # indexed page: page bound, then token bounds where the page survives
            w, offset, pb = load_page_terms(lo_ptr, sc_ptr, rad_ptr, page, h, stride_ms, stride_mh, q, D, BITS)
            keep_page = ((pb >= t) | (pb != pb)) & gmask
            skip = gmask & (keep_page == 0)
            n_skip += skip.to(tl.int32)
            dropped += tl.where(skip, P * tl.exp(sigma * (pb - ref)), 0.0).to(tl.float64) * MASS_UP
            keep = keep & keep_page[None, :]
            page_gate = gate_t
            if tl.max(keep_page.to(tl.int32), 0) > 0:
                n_read += tl.where(g == 0, 1, 0)
                wq, step, err = quantize_weights(w, BITS)
                codes = load_codes(codes_ptr, slots, h, stride_cs, stride_ch, D, BITS, p < end)
                u = token_bounds(codes, wq, step, err, offset)
                keep_tok = keep & ((u >= t[None, :]) | (u != u))
                lost = keep & (keep_tok == 0)
                lost_mass = tl.sum(tl.where(lost, tl.exp(sigma * (tl.minimum(u, pb[None, :]) - ref[None, :])), 0.0), 0)
                dropped += lost_mass.to(tl.float64) * MASS_UP
                keep = keep_tok
                page_first = ((pb >= t0) | (pb != pb)) & gmask & in_band
                first_keep = (valid[:, None] & page_first[None, :]) & ((u >= t0[None, :]) | (u != u))
                keep = keep & (first_keep == 0)
                row_first = tl.max(first_keep.to(tl.int32), 1)
        row = tl.max(keep.to(tl.int32), 1) > 0
        if tl.sum(row.to(tl.int32), 0) > 0:  # keys of candidates first
            keys = tl.load(k_ptr + slots[:, None] * stride_ks + h * stride_kh + dim[None, :],
                           mask=row[:, None], other=0.0)
            if Z_UNION:
                sc_exact, z_rows = scores_and_union_mass(keys, q, ref, row, gmask, sigma, QHI, D)
                z_union += z_rows
            else:
                sc_exact = exact_scores(keys, q, QHI)
            # a NaN score is never below the gate (keep semantics, as the torch and C++ steps)
            att = keep & ((sc_exact >= page_gate[None, :]) | (sc_exact != sc_exact))
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
            vals = tl.load(v_ptr + slots[:, None] * stride_vs + h * stride_vh + dv[None, :],
                           mask=vrow[:, None], other=0.0)
            if PV == tl.float32:
                acc = acc * alpha[:, None] + tl.dot(tl.trans(prob), vals, input_precision="ieee")
            else:
                acc = tl.dot(tl.trans(prob).to(PV), vals, acc=acc * alpha[:, None], out_dtype=tl.float32)
            m_i = m_new
            n_att += tl.sum(att.to(tl.int32), 0) * is_idx
            n_union += (row & (row_first == 0)).to(tl.int32) * is_idx
            n_values += (vrow & (row_first == 0)).to(tl.int32) * is_idx
            if KEEP_OUT:  # the band pass adds its ones to the first pass's
                out_mask = gmask[None, :] & valid[:, None] & (att | (in_band == 0))
                tl.store(keep_ptr + (head_row[None, :] * stride_kb) + (p * P + tok)[:, None], att.to(tl.int8),
                         mask=out_mask)
    split_row = (b * n_heads_kv + h) * tl.num_programs(2) + s
    tl.store(m_ptr + split_row * BG + g, m_i, mask=runs)
    tl.store(l_ptr + split_row * BG + g, l_i, mask=runs)
    tl.store(o_ptr + (split_row * BG + g[:, None]) * DV + dv[None, :], acc, mask=runs)
    if not FALLBACK_PASS:  # the counters stay the filter's
        counts = count_ptr + split_row * 5 * BG + g
        tl.store(counts, n_att)
        tl.store(counts + BG, n_skip)
        tl.store(counts + 2 * BG, tl.where(g == 0, tl.sum(n_union, 0), 0))
        tl.store(counts + 3 * BG, tl.where(g == 0, tl.sum(n_values, 0), 0))
        tl.store(counts + 4 * BG, n_read)
        tl.store(mass_ptr + split_row * 2 * BG + g, round_up_f32(dropped))
        tl.store(mass_ptr + split_row * 2 * BG + BG + g, round_up_f32(gated))
    tl.store(zown_ptr + split_row * BG + g, z_own, mask=runs)
    if Z_UNION:
        tl.store(zu_ptr + split_row * BG + g, z_union)


@triton.jit
def _merge_kernel(
    m_ptr, l_ptr, o_ptr, zown_ptr, out_ptr, zatt_ptr, stride_ob, stride_oh, sigma, S, sum_down,
    G: tl.constexpr, BG: tl.constexpr, DV: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Merge the splits' softmax states of one (request, query head) into the output, and their
    lower bounds of the attended mass into Z_att."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    h = head // G
    g = head % G
    dv = tl.arange(0, DV)
    base = (b * (tl.num_programs(1) // G) + h) * S
    top = float("-inf")
    for s0 in range(0, S, BLOCK_S):
        si = s0 + tl.arange(0, BLOCK_S)
        ms = tl.load(m_ptr + (base + si) * BG + g, mask=si < S, other=float("-inf"))
        top = tl.maximum(top, tl.max(ms, 0))
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    den = 0.0
    num = tl.zeros((DV,), tl.float32)
    z = tl.zeros((BLOCK_S,), tl.float64)
    for s0 in range(0, S, BLOCK_S):
        si = s0 + tl.arange(0, BLOCK_S)
        ms = tl.load(m_ptr + (base + si) * BG + g, mask=si < S, other=float("-inf"))
        w = tl.exp(ms - top_safe)
        keep = (si < S) & (w > 0)
        ls = tl.load(l_ptr + (base + si) * BG + g, mask=keep, other=0.0)
        den += tl.sum(ls * w, 0)
        os = tl.load(o_ptr + ((base + si) * BG + g)[:, None] * DV + dv[None, :], mask=keep[:, None], other=0.0)
        num += tl.sum(os * w[:, None], 0)
        z += tl.load(zown_ptr + (base + si) * BG + g, mask=keep, other=0.0)
    tl.store(out_ptr + b * stride_ob + head * stride_oh + dv, (num / den).to(out_ptr.dtype.element_ty))
    row = b * tl.num_programs(1) + head
    # a lower bound of the attended mass relative to exp(σ·ref): the splits' lowered sums
    tl.store(zatt_ptr + row, tl.sum(z, 0) * sum_down)


_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def block_g(groups: int, launch: TritonLaunch) -> int:
    """Query-head tile of the kernels: the GQA group size padded to a power of two >= 16."""
    return max(launch.min_block_g, triton.next_power_of_2(groups))


def num_splits(max_pages: int, launch: TritonLaunch) -> int:
    """Splits of a page table ``max_pages`` wide."""
    return triton.cdiv(max_pages, launch.pages_per_split)


def _kv_dtype(k_cache: torch.Tensor):
    if k_cache.dtype not in _DTYPES:
        raise ValueError(f"unsupported KV dtype {k_cache.dtype}; use float16, bfloat16 or float32")
    return _DTYPES[k_cache.dtype]


def edge_args(edges, with_margin: bool = False) -> dict:
    """The threshold edges' constexprs (``edges``: a ``contract.ThresholdEdges``)."""
    if edges.count + 2 > HIST_TILE.value:
        raise ValueError(f"{edges.count} threshold edges do not fit the histogram tile of {HIST_TILE.value} bins")
    args = dict(EDGE_LOW=float(edges.low), EDGE_STEP=float(edges.step), EDGE_COUNT=int(edges.count),
                HIST_WIDTH=int(edges.count) + 2)
    if with_margin:
        args["EDGE_MARGIN"] = float(edges.margin)
    return args


def exact_part(q, k_cache, page_table, seq_lens, ref, z_lb, sample, sigma: float, layout: dict, min_sparse: int,
               sum_down: float, launch: TritonLaunch = TritonLaunch(), budget_threshold=None, budget: float = 0.0,
               hist=None, habs=None) -> None:
    """Reference score, Z_lb and sample scores of a decode batch (and optionally the budget T,
    and zeroed certified histograms).

    Args:
        q: ``[B, H_q, D]`` queries (fp16/bf16/fp32, last dim contiguous).
        k_cache: ``[num_slots, H_kv, D]`` keys. page_table: ``[B, W]`` int32/int64 page ids;
            seq_lens: ``[B]`` int32/int64 tokens per request (>= 1).
        ref: ``[B, H_q]`` fp32 out; z_lb: ``[B, H_q]`` fp64 out; sample: ``[B, H_q, M]`` fp32 out
            (scores of the evenly spaced sample, −inf padded; M = sample size).
        layout: ``RequestLayout.constexprs`` of the request layout; min_sparse: its ``min_sparse_tokens``.
        sum_down: the contract's lowering of an fp64 sum for its rounding (Z_lb takes it).
        budget_threshold: optional ``[B, H_q]`` fp32 out: the budget policy's T for fraction
            ``budget`` (the max(1, floor(f·count))-th largest sample score).
        hist, habs: optional ``[B, H_q, W]`` fp64 histograms to zero for ``certified_hist``.
    """
    batch, heads, dim = q.shape
    h_kv = k_cache.shape[1]
    groups = heads // h_kv
    m = sample.shape[-1]
    _exact_part_kernel[(batch, h_kv)](
        q, k_cache, page_table, seq_lens, ref, z_lb, sample,
        budget_threshold if budget_threshold is not None else ref, hist if hist is not None else z_lb,
        habs if habs is not None else z_lb,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), page_table.stride(0), float(sigma),
        float(budget), int(min_sparse), float(sum_down), **layout,
        D=dim, G=groups, BG=block_g(groups, launch), M=m, MP=triton.next_power_of_2(m), BLOCK_T=launch.exact_block,
        QHI=_kv_dtype(k_cache), BUDGET=budget_threshold is not None, ZERO_HIST=hist is not None,
        HIST_WIDTH=hist.shape[-1] if hist is not None else 1, num_warps=launch.exact_warps,
    )


def certified_hist(q, page_table, seq_lens, index: dict, ref, hist, habs, sigma: float, layout: dict,
                   min_sparse: int, bits: int, edges, launch: TritonLaunch = TritonLaunch(), flagged=None) -> None:
    """Accumulate the certified histograms (zeroed by ``exact_part``).

    Args:
        index: grid tensors ``lo``/``scale``/``radius`` ``[num_pages, H_kv, D]`` and ``codes``
            ``[num_slots, H_kv, D * bits // 8]`` uint8.
        ref: ``[B, H_q]`` fp32 from ``exact_part``.
        hist, habs: ``[B, H_q, edges.count + 2]`` fp64: signed mass per edge bin and its absolute terms.
        edges: the threshold edges (``contract.ThresholdEdges``).
        flagged: optional ``[B]`` bool: only these requests' pages are counted.
    Other arguments as in ``exact_part``.
    """
    batch, heads, dim = q.shape
    lo = index["lo"]
    h_kv = lo.shape[1]
    groups = heads // h_kv
    grid = (batch, h_kv, num_splits(page_table.shape[1], launch))
    _certified_hist_kernel[grid](
        q, page_table, seq_lens, lo, index["scale"], index["radius"], index["codes"], ref, hist, habs,
        flagged if flagged is not None else seq_lens, q.stride(0), q.stride(1), page_table.stride(0), lo.stride(0),
        lo.stride(1),
        index["codes"].stride(0), index["codes"].stride(1), float(sigma), int(min_sparse), **layout,
        D=dim, G=groups, BG=block_g(groups, launch), BITS=bits, SPLIT=launch.pages_per_split, **edge_args(edges),
        FLAGGED=flagged is not None, num_warps=launch.hist_warps,
    )


def certified_threshold(hist, habs, ref, z_lb, threshold, certificate, sigma: float, eps_budget: float,
                        rounding: float, h_kv: int, edges, launch: TritonLaunch = TritonLaunch()) -> None:
    """Certified T per head from the histograms (``threshold.certified_choice``'s rule).

    Args:
        hist, habs: ``[B, H_q, edges.count + 2]`` fp64 from ``certified_hist``; ref ``[B, H_q]``
            fp32; z_lb ``[B, H_q]`` fp64. threshold: ``[B, H_q]`` fp32 out (−inf where no edge
            fits); certificate: ``[B, H_q]`` fp64 out: the certified dropped mass relative to ref.
        eps_budget: eps times the fp64 safety factor; rounding: relative bound on the
            histograms' fp64 rounding (added as rounding · Σ|terms|).
    """
    batch, heads = ref.shape
    groups = heads // h_kv
    _certified_threshold_kernel[(batch, h_kv)](
        hist, habs, ref, z_lb, threshold, certificate, float(sigma), float(eps_budget), float(rounding),
        G=groups, BG=block_g(groups, launch), **edge_args(edges, with_margin=True), num_warps=launch.hist_warps,
    )


def attend(q, k_cache, v_cache, page_table, seq_lens, index: dict, threshold, ref, m, l, o, counts,
           mass, z_own, sigma: float, layout: dict, min_sparse: int, bits: int, gate: bool, gate_rel: float,
           launch: TritonLaunch = TritonLaunch(), attended=None, fallback=None, z_union=None,
           band_ceiling=None) -> None:
    """Fused filter and sparse split-K attention.

    Args:
        q, k_cache, page_table, seq_lens, index, layout, min_sparse: as in ``exact_part`` /
            ``certified_hist``; v_cache ``[num_slots, H_kv, D_v]``.
        threshold, ref: ``[B, H_q]`` fp32: T (keys whose bound reaches it are candidates) and ref.
        gate: candidates scoring below T − gate_rel·(|T| + 1) skip their V read (budget and
            fixed policies; ``contract.ValueGate``).
        m, l: ``[B, H_kv, S, BG]`` fp32 out: running max (σ·score units) and softmax sum per split.
        o: ``[B, H_kv, S, BG, D_v]`` fp32 out: unnormalised output per split.
        counts: ``[B, H_kv, S, 5, BG]`` int32 out: attended keys, skipped pages and pages whose
            codes were read per head, then (in column 0) union candidates and V rows read.
        mass: ``[B, H_kv, S, 2, BG]`` fp32 out: index-dropped and value-gated mass relative to ref
            (upper bounds: fp32 sums raised by their rounding, gated scores by theirs).
        z_own: ``[B, H_kv, S, BG]`` fp64 out: per split and head a lower bound of the mass of the
            rows it attended (scores lowered by their rounding bound), which ``merge`` sums into
            Z_att (written by the fallback pass too, for its requests).
        attended: optional ``[B, H_q, W * P]`` int8 out (callers zero it): 1 for every token
            position attended (for tests and audits; the fast path leaves it None).
        fallback: optional ``[B]`` bool: the dense-fallback pass, which recomputes m, l, o of the
            flagged requests densely (T = −inf, no gate) and writes nothing else.
        z_union: optional ``[B, H_kv, S, BG]`` fp64 out: per split and head, a lower bound of
            Σ exp(σ(s − ref)) over every row some head of the group attends (dense rows and the
            GQA union of candidates): the a-posteriori rule's Z_att.
        band_ceiling: optional ``[B, H_q]`` fp32: the band pass of the a-posteriori rule. It
            attends only the indexed tokens kept at ``threshold`` (the lowered level; +inf for a
            head not lowered) and not at ``band_ceiling`` (the first pass's T), and writes the
            split state and counters of that band alone (union and value counts without the
            rows the first pass read; ``attended`` gains its ones).
    S = ``num_splits(page_table.shape[1], launch)``; BG = ``block_g(H_q // H_kv, launch)``.
    """
    batch, heads, dim = q.shape
    lo = index["lo"]
    h_kv, d_v = k_cache.shape[1], v_cache.shape[2]
    groups = heads // h_kv
    grid = (batch, h_kv, num_splits(page_table.shape[1], launch))
    kv = _kv_dtype(k_cache)
    _attend_kernel[grid](
        q, k_cache, v_cache, page_table, seq_lens, lo, index["scale"], index["radius"], index["codes"],
        threshold, ref, m, l, o, counts, mass, attended if attended is not None else counts,
        fallback if fallback is not None else seq_lens, band_ceiling if band_ceiling is not None else threshold,
        z_union if z_union is not None else mass, z_own,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        page_table.stride(0), lo.stride(0), lo.stride(1), index["codes"].stride(0), index["codes"].stride(1),
        attended.stride(1) if attended is not None else 0, float(sigma), launch.pages_per_split, int(min_sparse),
        int(band_ceiling is not None),
        **layout, D=dim, DV=d_v, G=groups, BG=block_g(groups, launch), BITS=bits, QHI=kv, PV=kv,
        GATE=gate and fallback is None, GATE_REL=float(gate_rel), KEEP_OUT=attended is not None,
        FALLBACK_PASS=fallback is not None, Z_UNION=z_union is not None,
        num_warps=launch.attend_warps, num_stages=launch.attend_stages,
    )


def merge(m, l, o, z_own, out, z_att, sigma: float, sum_down: float, launch: TritonLaunch = TritonLaunch()) -> None:
    """Merge split states into the output.

    Args:
        m, l, o: from ``attend``. z_own: ``[B, H_kv, S, BG]`` fp64 from ``attend``.
        out: ``[B, H_q, D_v]`` (any float dtype, last dim contiguous) out.
        z_att: ``[B, H_q]`` fp64 out: a lower bound of the attended softmax mass relative to
            exp(σ·ref) (the splits' z_own, their fp64 sum times ``sum_down``, the contract's
            allowance for its rounding).
    """
    batch, h_kv, splits, bg = m.shape
    heads, d_v = out.shape[1], out.shape[2]
    _merge_kernel[(batch, heads)](
        m, l, o, z_own, out, z_att, out.stride(0), out.stride(1), float(sigma), splits, float(sum_down),
        G=heads // h_kv, BG=bg, DV=d_v, BLOCK_S=launch.merge_block, num_warps=launch.merge_warps,
    )
