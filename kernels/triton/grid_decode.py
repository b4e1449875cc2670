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
  state and counters. Splits are merged in ``louver_sgl.decode.gpu``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .grid_bounds import (
    exact_scores, load_codes, load_page_terms, quantize_weights, request_layout, token_bounds,
)
from .launch import TritonLaunch

EDGE_LOW = tl.constexpr(-48.0)
EDGE_STEP = tl.constexpr(0.25)
EDGE_COUNT = tl.constexpr(257)
HIST_WIDTH = tl.constexpr(259)


@triton.jit
def _token_position(i, n_sink_tok, n_dense, end, first, n_idx, M: tl.constexpr, P: tl.constexpr):
    """Position in the request of virtual token i: dense part first, then the sample."""
    j = (i - n_dense).to(tl.int64)
    spaced = tl.where(n_idx > M, j * n_idx // M, j)
    sample_pos = first * P + spaced
    dense_pos = tl.where(i < n_sink_tok, i, end * P + (i - n_sink_tok))
    return tl.where(i < n_dense, dense_pos.to(tl.int64), sample_pos)


@triton.jit
def _exact_part_kernel(
    q_ptr, k_ptr, table_ptr, lens_ptr, ref_ptr, zlb_ptr, sample_ptr,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_tb, sigma,
    P: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BG: tl.constexpr,
    SINK: tl.constexpr, RECENT: tl.constexpr, M: tl.constexpr, BLOCK_T: tl.constexpr,
    QHI: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b).to(tl.int64)
    pages, first, end = request_layout(seq_len, P, SINK, RECENT)
    n_sink_tok = first * P
    n_dense = n_sink_tok + seq_len - end * P
    n_idx = (end - first) * P
    total = n_dense + tl.minimum(n_idx, M)
    g = tl.arange(0, BG)
    gmask = g < G
    dim = tl.arange(0, D)
    heads = h * G + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dim[None, :],
                mask=gmask[:, None], other=0.0).to(tl.float32)
    m = tl.full((BG,), float("-inf"), tl.float32)
    for start in range(0, total, BLOCK_T):
        i = start + tl.arange(0, BLOCK_T)
        valid = i < total
        pos = _token_position(i, n_sink_tok, n_dense, end, first, n_idx, M, P)
        page = tl.load(table_ptr + b * stride_tb + pos // P, mask=valid, other=0).to(tl.int64)
        slot = page * P + pos % P
        keys = tl.load(k_ptr + slot[:, None] * stride_ks + h * stride_kh + dim[None, :],
                       mask=valid[:, None], other=0.0)
        s = tl.where(valid[:, None], exact_scores(keys, q, QHI), float("-inf"))
        m = tl.maximum(m, tl.max(s, 0))
        j = i - n_dense
        is_sample = valid & (i >= n_dense)
        tl.store(sample_ptr + (b * tl.num_programs(1) * G + heads[None, :]) * M + j[:, None],
                 s, mask=is_sample[:, None] & gmask[None, :])
    for j0 in range(tl.minimum(n_idx, M), M, BLOCK_T):
        j = j0 + tl.arange(0, BLOCK_T)
        tl.store(sample_ptr + (b * tl.num_programs(1) * G + heads[None, :]) * M + j[:, None],
                 tl.full((BLOCK_T, BG), float("-inf"), tl.float32), mask=(j < M)[:, None] & gmask[None, :])
    z = tl.zeros((BG,), tl.float64)
    qa = tl.abs(q)
    ref64 = m.to(tl.float64)
    for start in range(0, total, BLOCK_T):
        i = start + tl.arange(0, BLOCK_T)
        valid = i < total
        pos = _token_position(i, n_sink_tok, n_dense, end, first, n_idx, M, P)
        page = tl.load(table_ptr + b * stride_tb + pos // P, mask=valid, other=0).to(tl.int64)
        slot = page * P + pos % P
        keys = tl.load(k_ptr + slot[:, None] * stride_ks + h * stride_kh + dim[None, :],
                       mask=valid[:, None], other=0.0)
        s = exact_scores(keys, q, QHI)
        mag = exact_scores(tl.abs(keys), qa, QHI)
        # Lower the computed score by its rounding bound (fp32 sums, split-q residual) so that
        # Z_lb stays a lower bound of the exact denominator.
        s_lb = s - mag * (2.0 * (D + 8) * 5.9604644775390625e-08 + 7.62939453125e-06)
        x = sigma * (s_lb.to(tl.float64) - ref64[None, :])
        z += tl.sum(tl.where(valid[:, None], tl.exp(x), 0.0), 0)
    out = b * tl.num_programs(1) * G + heads
    tl.store(ref_ptr + out, m, mask=gmask)
    tl.store(zlb_ptr + out, z * (1.0 - 1e-9), mask=gmask)


@triton.jit
def _edge_bin(x):
    """Number of threshold edges <= x (fp64); NaN maps past the last edge."""
    b = tl.floor((x - EDGE_LOW) / EDGE_STEP) + 1.0
    b = tl.minimum(tl.maximum(b, 0.0), EDGE_COUNT * 1.0)
    return tl.where(x == x, b, EDGE_COUNT * 1.0).to(tl.int32)


@triton.jit
def _certified_hist_kernel(
    q_ptr, table_ptr, lens_ptr, lo_ptr, sc_ptr, rad_ptr, codes_ptr, ref_ptr, hist_ptr, habs_ptr,
    stride_qb, stride_qh, stride_tb, stride_ms, stride_mh, stride_cs, stride_ch, sigma,
    P: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, BITS: tl.constexpr,
    SINK: tl.constexpr, RECENT: tl.constexpr, SPLIT,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b).to(tl.int64)
    pages, first, end = request_layout(seq_len, P, SINK, RECENT)
    g = tl.arange(0, BG)
    gmask = g < G
    dim = tl.arange(0, D)
    heads = h * G + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dim[None, :],
                mask=gmask[:, None], other=0.0).to(tl.float32)
    head_row = b * tl.num_programs(1) * G + heads
    ref = tl.load(ref_ptr + head_row, mask=gmask, other=0.0).to(tl.float64)
    base = head_row * HIST_WIDTH
    p0 = first + s * SPLIT
    for p in range(p0, tl.minimum(p0 + SPLIT, end)):
        page = tl.load(table_ptr + b * stride_tb + p).to(tl.int64)
        w, offset, pb = load_page_terms(lo_ptr, sc_ptr, rad_ptr, page, h, stride_ms, stride_mh, q, D, BITS)
        wq, step, err = quantize_weights(w, BITS)
        slots = page * P + tl.arange(0, P)
        u = token_bounds(load_codes(codes_ptr, slots, h, stride_cs, stride_ch, D, BITS), wq, step, err, offset)
        u = tl.minimum(u, pb[None, :])
        x_page = sigma * (pb.to(tl.float64) - ref)
        x_tok = sigma * (u.to(tl.float64) - ref[None, :])
        b_page = _edge_bin(x_page)
        b_tok = _edge_bin(x_tok)
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
    t_ptr, gate_ptr, ref_ptr, m_ptr, l_ptr, o_ptr, count_ptr, mass_ptr, keep_ptr,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tb,
    stride_ms, stride_mh, stride_cs, stride_ch, stride_kb, sigma,
    P: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, G: tl.constexpr, BG: tl.constexpr,
    BITS: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr, SPLIT,
    QHI: tl.constexpr, PV: tl.constexpr, KEEP_OUT: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    n_heads_kv = tl.num_programs(1)
    seq_len = tl.load(lens_ptr + b).to(tl.int64)
    pages, first, end = request_layout(seq_len, P, SINK, RECENT)
    g = tl.arange(0, BG)
    gmask = g < G
    dim = tl.arange(0, D)
    dv = tl.arange(0, DV)
    tok = tl.arange(0, P)
    heads = h * G + g
    head_row = b * n_heads_kv * G + heads
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dim[None, :],
                mask=gmask[:, None], other=0.0).to(tl.float32)
    t = tl.load(t_ptr + head_row, mask=gmask, other=float("inf"))
    gate_t = tl.load(gate_ptr + head_row, mask=gmask, other=float("inf"))
    ref = tl.load(ref_ptr + head_row, mask=gmask, other=0.0)
    m_i = tl.full((BG,), float("-inf"), tl.float32)
    l_i = tl.zeros((BG,), tl.float32)
    acc = tl.zeros((BG, DV), tl.float32)
    n_att = tl.zeros((BG,), tl.int32)
    n_skip = tl.zeros((BG,), tl.int32)
    dropped = tl.zeros((BG,), tl.float32)
    gated = tl.zeros((BG,), tl.float32)
    n_union = 0
    n_values = 0
    n_read = 0
    p0 = s * SPLIT
    for p in range(p0, tl.minimum(p0 + SPLIT, pages)):
        page = tl.load(table_ptr + b * stride_tb + p).to(tl.int64)
        slots = page * P + tok
        keep = ((p * P + tok) < seq_len)[:, None] & gmask[None, :]
        indexed = (p >= first) & (p < end)
        if indexed:
            w, offset, pb = load_page_terms(lo_ptr, sc_ptr, rad_ptr, page, h, stride_ms, stride_mh, q, D, BITS)
            keep_page = (pb >= t) | (pb != pb)
            skip = gmask & ~keep_page
            n_skip += skip.to(tl.int32)
            dropped += tl.where(skip, P * tl.exp(sigma * (pb - ref)), 0.0)
            keep = keep & keep_page[None, :]
            if tl.max(keep_page.to(tl.int32), 0) > 0:
                n_read += 1
                wq, step, err = quantize_weights(w, BITS)
                u = token_bounds(load_codes(codes_ptr, slots, h, stride_cs, stride_ch, D, BITS),
                                 wq, step, err, offset)
                keep = keep & ((u >= t[None, :]) | (u != u))
                out = keep_page[None, :] & ~keep & gmask[None, :]
                dropped += tl.sum(tl.where(out, tl.exp(sigma * (tl.minimum(u, pb[None, :]) - ref[None, :])), 0.0), 0)
        row = tl.max(keep.to(tl.int32), 1) > 0
        if tl.sum(row.to(tl.int32), 0) > 0:
            keys = tl.load(k_ptr + slots[:, None] * stride_ks + h * stride_kh + dim[None, :],
                           mask=row[:, None], other=0.0)
            sc = exact_scores(keys, q, QHI)
            page_gate = tl.where(indexed, gate_t, float("-inf"))  # dense rows are never gated
            att = keep & (sc >= page_gate[None, :])
            gated += tl.sum(tl.where(keep & ~att, tl.exp(sigma * (sc - ref[None, :])), 0.0), 0)
            x = tl.where(att, sigma * sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(x, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            prob = tl.exp(x - m_safe[None, :])
            l_i = l_i * alpha + tl.sum(prob, 0)
            vrow = tl.max(att.to(tl.int32), 1) > 0
            vals = tl.load(v_ptr + slots[:, None] * stride_vs + h * stride_vh + dv[None, :],
                           mask=vrow[:, None], other=0.0)
            if PV == tl.float32:
                acc = acc * alpha[:, None] + tl.dot(tl.trans(prob), vals, input_precision="ieee")
            else:
                acc = tl.dot(tl.trans(prob).to(PV), vals, acc=acc * alpha[:, None], out_dtype=tl.float32)
            m_i = m_new
            if indexed:
                n_att += tl.sum(att.to(tl.int32), 0)
                n_union += tl.sum(row.to(tl.int32), 0)
                n_values += tl.sum(vrow.to(tl.int32), 0)
            if KEEP_OUT:
                pos = p * P + tok
                tl.store(keep_ptr + (head_row[None, :] * stride_kb) + pos[:, None], att.to(tl.int8),
                         mask=gmask[None, :])
    split_row = (b * n_heads_kv + h) * tl.num_programs(2) + s
    tl.store(m_ptr + split_row * BG + g, m_i)
    tl.store(l_ptr + split_row * BG + g, l_i)
    tl.store(o_ptr + (split_row * BG + g[:, None]) * DV + dv[None, :], acc)
    counts = count_ptr + split_row * 5 * BG + g
    tl.store(counts, n_att)
    tl.store(counts + BG, n_skip)
    tl.store(counts + 2 * BG, tl.where(g == 0, n_union, 0))
    tl.store(counts + 3 * BG, tl.where(g == 0, n_values, 0))
    tl.store(counts + 4 * BG, tl.where(g == 0, n_read, 0))
    tl.store(mass_ptr + split_row * 2 * BG + g, dropped)
    tl.store(mass_ptr + split_row * 2 * BG + BG + g, gated)


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


def exact_part(q, k_cache, page_table, seq_lens, ref, z_lb, sample, sigma: float, page_size: int,
               sink_pages: int, recent_pages: int, launch: TritonLaunch = TritonLaunch()) -> None:
    """Reference score, Z_lb and sample scores of a decode batch.

    Args:
        q: ``[B, H_q, D]`` queries (fp16/bf16/fp32, last dim contiguous).
        k_cache: ``[num_slots, H_kv, D]`` keys. page_table: ``[B, W]`` int32/int64 page ids;
            seq_lens: ``[B]`` int32/int64 tokens per request (>= 1).
        ref: ``[B, H_q]`` fp32 out; z_lb: ``[B, H_q]`` fp64 out; sample: ``[B, H_q, M]`` fp32 out
            (scores of the evenly spaced sample, −inf padded; M = sample size).
    """
    batch, heads, dim = q.shape
    h_kv = k_cache.shape[1]
    groups = heads // h_kv
    _exact_part_kernel[(batch, h_kv)](
        q, k_cache, page_table, seq_lens, ref, z_lb, sample,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), page_table.stride(0), float(sigma),
        P=page_size, D=dim, G=groups, BG=block_g(groups, launch), SINK=sink_pages, RECENT=recent_pages,
        M=sample.shape[-1], BLOCK_T=launch.exact_block, QHI=_kv_dtype(k_cache), num_warps=launch.exact_warps,
    )


def certified_hist(q, page_table, seq_lens, index: dict, ref, hist, habs, sigma: float, page_size: int,
                   bits: int, sink_pages: int, recent_pages: int, launch: TritonLaunch = TritonLaunch()) -> None:
    """Accumulate the certified histograms (callers zero them first).

    Args:
        index: grid tensors ``lo``/``scale``/``radius`` ``[num_pages, H_kv, D]`` and ``codes``
            ``[num_slots, H_kv, D * bits // 8]`` uint8.
        ref: ``[B, H_q]`` fp32 from ``exact_part``.
        hist, habs: ``[B, H_q, 259]`` fp64: signed mass per edge bin and its absolute terms.
    Other arguments as in ``exact_part``.
    """
    batch, heads, dim = q.shape
    lo = index["lo"]
    h_kv = lo.shape[1]
    groups = heads // h_kv
    grid = (batch, h_kv, num_splits(page_table.shape[1], launch))
    _certified_hist_kernel[grid](
        q, page_table, seq_lens, lo, index["scale"], index["radius"], index["codes"], ref, hist, habs,
        q.stride(0), q.stride(1), page_table.stride(0), lo.stride(0), lo.stride(1),
        index["codes"].stride(0), index["codes"].stride(1), float(sigma),
        P=page_size, D=dim, G=groups, BG=block_g(groups, launch), BITS=bits,
        SINK=sink_pages, RECENT=recent_pages, SPLIT=launch.pages_per_split, num_warps=launch.hist_warps,
    )


def attend(q, k_cache, v_cache, page_table, seq_lens, index: dict, threshold, gate, ref, m, l, o, counts,
           mass, sigma: float, page_size: int, bits: int, sink_pages: int, recent_pages: int,
           launch: TritonLaunch = TritonLaunch(), attended=None) -> None:
    """Fused filter and sparse split-K attention.

    Args:
        q, k_cache, page_table, seq_lens, index: as in ``exact_part`` / ``certified_hist``;
            v_cache ``[num_slots, H_kv, D_v]``.
        threshold, gate, ref: ``[B, H_q]`` fp32: T (keys whose bound reaches it are candidates),
            the value gate (candidates scoring below it skip V; −inf: no gate) and ref.
        m, l: ``[B, H_kv, S, BG]`` fp32 out: running max (σ·score units) and softmax sum per split.
        o: ``[B, H_kv, S, BG, D_v]`` fp32 out: unnormalised output per split.
        counts: ``[B, H_kv, S, 5, BG]`` int32 out: attended keys and skipped pages per head, then
            (in column 0) union candidates, V rows read and pages whose codes were read.
        mass: ``[B, H_kv, S, 2, BG]`` fp32 out: index-dropped and value-gated mass relative to ref.
        attended: optional ``[B, H_q, W * P]`` int8 out (callers zero it): 1 for every token
            position attended (for tests and audits; the fast path leaves it None).
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
        threshold, gate, ref, m, l, o, counts, mass, attended if attended is not None else counts,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        page_table.stride(0), lo.stride(0), lo.stride(1), index["codes"].stride(0), index["codes"].stride(1),
        attended.stride(1) if attended is not None else 0, float(sigma),
        P=page_size, D=dim, DV=d_v, G=groups, BG=block_g(groups, launch), BITS=bits,
        SINK=sink_pages, RECENT=recent_pages, SPLIT=launch.pages_per_split, QHI=kv, PV=kv,
        KEEP_OUT=attended is not None,
        num_warps=launch.attend_warps, num_stages=launch.attend_stages,
    )
