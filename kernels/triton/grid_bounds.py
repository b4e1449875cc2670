"""Device functions shared by the GPU decode kernels: request layout, page codebook terms and
sound token upper bounds of the grid family (specification: ``louver_sgl.index.grid``).

Token bounds use integer arithmetic on the tensor cores: per page and query head the fp32 weights
w_d = q_d·scale_d are written as step·wq_d with wq_d an integer in [−127, 127]; codes (< 2^bits)
and wq are exact in fp16, their products (< 2^15) and every partial sum (< 2^24 for D <= 128)
are exact in the fp32 accumulator, so Σ_d code_d·wq_d is computed exactly. Then
    Σ_d w_d·code_d <= step·Σ_d wq_d·code_d + (2^bits − 1)·Σ_d |w_d − step·wq_d| (+ rounding terms),
the same form as the compiled CPU kernel. A non-finite weight makes the error term NaN: keep.
"""

from __future__ import annotations

import triton
import triton.language as tl

# 2·(n + 8)·u for the fp32 sums of ``louver_sgl.index.numerics.dot_slack``.
FP32_U = tl.constexpr(5.9604644775390625e-08)


@triton.jit
def request_layout(seq_len, P: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr, min_sparse):
    """(pages, first indexed page, end of indexed pages) of a request with ``seq_len`` tokens:
    ``louver_sgl.decode.contract.RequestLayout.split`` on the device.

    Pages [0, first) are sink pages, [first, end) indexed, [end, pages) recent pages and the tail;
    a request shorter than ``min_sparse`` tokens has no indexed page.
    """
    full = seq_len // P
    sink = tl.minimum(full, SINK)
    recent = tl.minimum(full - sink, RECENT)
    pages = (seq_len + P - 1) // P
    short = seq_len < min_sparse
    return pages, tl.where(short, full, sink), tl.where(short, full, full - recent)


@triton.jit
def group_queries(q_ptr, b, h, stride_qb, stride_qh, G: tl.constexpr, BG: tl.constexpr, D: tl.constexpr):
    """The query rows of KV head h's GQA group in request b.

    Returns (g ``[BG]`` row ids, gmask ``[BG]`` rows < G, head_row ``[BG]`` flat (request, query
    head) index, q ``[BG, D]`` fp32 with zero padding rows).
    """
    g = tl.arange(0, BG)
    gmask = g < G
    heads = h * G + g
    dim = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dim[None, :],
                mask=gmask[:, None], other=0.0).to(tl.float32)
    return g, gmask, b * tl.num_programs(1) * G + heads, q


@triton.jit
def page_terms(q, lo, sc, rad, D: tl.constexpr, BITS: tl.constexpr):
    """Query terms of one page. q ``[BG, D]`` fp32; lo, sc, rad ``[D]`` fp32.

    Returns (weights ``[BG, D]``, offset ``[BG]``, page_bound ``[BG]``); offset and page bound
    include the fp32 slack of ``dot_slack``.
    """
    w, offset, pb, _ = page_terms_and_slack(q, lo, sc, rad, D, BITS)
    return w, offset, pb


@triton.jit
def page_terms_and_slack(q, lo, sc, rad, D: tl.constexpr, BITS: tl.constexpr):
    """``page_terms`` and the slack ``[BG]`` it added: a bound on the rounding of its sums in any
    evaluation order (so two kernels' offsets and page bounds differ by at most twice it). lo,
    sc, rad ``[D]`` (one page) or ``[BG, D]`` (a page per row)."""
    levels: tl.constexpr = 1 << BITS
    if len(lo.shape) == 1:
        lo = lo[None, :]
        sc = sc[None, :]
        rad = rad[None, :]
    qa = tl.abs(q)
    radius_term = tl.sum(qa * rad, 1)
    w = q * sc
    c_min = lo + 0.5 * sc
    c_max = lo + (levels - 0.5) * sc
    offset = tl.sum(q * c_min, 1) + radius_term
    pb = tl.sum(tl.maximum(q * c_min, q * c_max), 1) + radius_term
    magnitude = tl.sum(qa * (tl.abs(lo) + levels * tl.abs(sc) + rad), 1)
    terms: tl.constexpr = 2 * D + 2 + 8
    slack = magnitude * (2.0 * terms * FP32_U) + terms * 7.346839692639297e-40
    return w, offset + slack, pb + slack, slack


@triton.jit
def order_envelopes(u, pb, offset, err, slack, D: tl.constexpr):
    """How far another kernel's evaluation of the same bounds can lie below these, from the
    order of its sums and its fused multiply-adds: (token ``[P, BG]``, page ``[BG]``) fp32.
    Offsets and page bounds differ by at most 2·slack (``page_terms_and_slack``); the weights'
    error term err is a D-term sum of positive terms (relative 2·D·u between two orders); the
    final additions of ``token_bounds`` and ``page_terms`` round within 4·u of their magnitudes."""
    page = 3.0 * slack + 8.0 * FP32_U * tl.abs(pb)
    tok = page[None, :] + (2 * D + 16) * FP32_U * (tl.abs(u) + 2.0 * tl.abs(offset)[None, :] + 2.0 * err[None, :])
    return tok, page


@triton.jit
def quantize_weights(w, BITS: tl.constexpr):
    """Integer form of token weights. w ``[BG, D]`` fp32 -> (wq ``[BG, D]`` fp16 integers,
    step ``[BG]``, err ``[BG]``) with Σ_d w_d·c_d <= step·Σ_d wq_d·c_d + err for codes c."""
    top = tl.max(tl.abs(w), 1)
    step = tl.where(top > 0, top / 127.0, 1.0)
    r = tl.floor(w / step[:, None] + 0.5)
    r = tl.minimum(tl.maximum(r, -127.0), 127.0)
    r = tl.where(r == r, r, 0.0)
    sw = step[:, None] * r
    err = tl.sum(tl.maximum(w - sw, 0.0), 1)  # codes are >= 0: only channels rounded down raise the sum
    mag = tl.sum(tl.abs(sw), 1)
    levels: tl.constexpr = (1 << BITS) - 1
    # (1 + 2^-16) and the 2^-20 relative term cover fp32 rounding of err, of step·wq and step·acc.
    err = levels * (err * (1.0 + 1.52587890625e-05) + mag * 9.5367431640625e-07) + 1.1754943508222875e-38
    err = tl.where(top < float("inf"), err, float("nan"))
    return r.to(tl.float16), step, err


@triton.jit
def load_codes(codes_ptr, slots, h, stride_cs, stride_ch, D: tl.constexpr, BITS: tl.constexpr, read):
    """Unpacked codes ``[P, D]`` fp16 of token rows ``slots`` ``[P]`` (int64) and KV head h;
    zeros without a memory read where the scalar ``read`` is false."""
    per_byte: tl.constexpr = 8 // BITS
    dim = tl.arange(0, D)
    byte = tl.load(codes_ptr + slots[:, None] * stride_cs + h * stride_ch + (dim // per_byte)[None, :],
                   mask=read, other=0)
    mask: tl.constexpr = (1 << BITS) - 1
    return ((byte.to(tl.int32) >> ((dim % per_byte) * BITS)[None, :]) & mask).to(tl.float16)


@triton.jit
def token_bounds(codes, wq, step, err, offset):
    """Token upper bounds ``[P, BG]`` fp32 from codes ``[P, D]`` fp16 and ``quantize_weights``."""
    # Query heads as the M side (16 rows): an mma tile that pipelines on every GPU generation.
    acc = tl.trans(tl.dot(wq, tl.trans(codes), out_dtype=tl.float32))  # exact integers
    return offset[None, :] + step[None, :] * acc + err[None, :]


@triton.jit
def load_page_terms(lo_ptr, sc_ptr, rad_ptr, page, h, stride_ms, stride_mh, q,
                    D: tl.constexpr, BITS: tl.constexpr):
    """``page_terms`` of page ``page`` (int64) and KV head h from the stored codebooks."""
    w, offset, pb, _ = load_page_terms_and_slack(lo_ptr, sc_ptr, rad_ptr, page, h, stride_ms, stride_mh, q, D, BITS)
    return w, offset, pb


@triton.jit
def load_page_terms_and_slack(lo_ptr, sc_ptr, rad_ptr, page, h, stride_ms, stride_mh, q,
                              D: tl.constexpr, BITS: tl.constexpr):
    """``page_terms_and_slack`` of page ``page`` (int64) and KV head h."""
    dim = tl.arange(0, D)
    meta = page * stride_ms + h * stride_mh + dim
    lo = tl.load(lo_ptr + meta).to(tl.float32)
    sc = tl.load(sc_ptr + meta).to(tl.float32)
    rad = tl.load(rad_ptr + meta).to(tl.float32)
    return page_terms_and_slack(q, lo, sc, rad, D, BITS)


@triton.jit
def exact_scores(keys, q, QHI_DTYPE: tl.constexpr):
    """Scores ``[T, BG]`` fp32 of keys ``[T, D]`` (KV dtype) against q ``[BG, D]`` fp32.

    fp16/bf16 keys: q is split into a high and a low part in the key dtype, so both tensor-core
    products are exact and the result carries fp32-level error; fp32 keys use an fp32 dot.
    """
    keys_t = tl.trans(keys)
    if QHI_DTYPE == tl.float32:
        return tl.trans(tl.dot(q, keys_t, input_precision="ieee"))
    else:
        q_hi = q.to(QHI_DTYPE)
        q_lo = (q - q_hi.to(tl.float32)).to(QHI_DTYPE)
        s = tl.dot(q_hi, keys_t, out_dtype=tl.float32)
        return tl.trans(tl.dot(q_lo, keys_t, acc=s, out_dtype=tl.float32))


@triton.jit
def scores_with_lower_bounds(keys, q, QHI: tl.constexpr, D: tl.constexpr):
    """(scores, lower bounds of the exact scores) ``[T, BG]`` fp32 of keys ``[T, D]``."""
    s = exact_scores(keys, q, QHI)
    mag = exact_scores(tl.abs(keys), tl.abs(q), QHI)
    # rounding bound of the fp32 sums plus the split-q residual (<= 2^-17 relative)
    return s, s - mag * (2.0 * (D + 8) * 5.9604644775390625e-08 + 7.62939453125e-06)


@triton.jit
def scores_and_union_mass(keys, q, ref, rows, gmask, sigma, QHI: tl.constexpr, D: tl.constexpr):
    """(scores ``[T, BG]`` fp32, per head the fp64 lower bound of Σ exp(σ(s − ref)) over the
    ``rows`` ``[T]`` some head attends): the a-posteriori rule's Z_att terms. NaN terms add 0."""
    s, s_lb = scores_with_lower_bounds(keys, q, QHI, D)
    x_lb = tl.minimum(sigma * (s_lb.to(tl.float64) - ref[None, :].to(tl.float64)), 700.0)
    in_union = rows[:, None] & gmask[None, :] & (x_lb == x_lb)
    return s, tl.sum(tl.where(in_union, tl.exp(x_lb), 0.0), 0)


# fp32 mass terms e^{σ(x)} summed over a tile of at most 256 rows carry relative error below
# 2^-15 (argument rounding up to |x|·3u for |x| <= 88, the exp's own, the tile's sum); sums that
# must be upper bounds take this factor before joining their fp64 accumulator.
MASS_UP = tl.constexpr(1.0001220703125)  # 1 + 2^-13


@triton.jit
def query_norms(q):
    """Upper bounds ``[BG]`` of ‖q_g‖ for q ``[BG, D]`` fp32 (fp32 norm, raised by 2^-12)."""
    return tl.sqrt(tl.sum(q * q, 1)) * 1.000244140625


@triton.jit
def score_errors(keys, q_norm, D: tl.constexpr):
    """Bounds ``[T, BG]`` on |fp32 score − q·k| of ``exact_scores`` for keys ``[T, D]``: the
    rounding of the fp32 sums and the split-q residual, as in ``scores_with_lower_bounds``, times
    ‖q‖·‖k‖ >= Σ|q_d·k_d| (Cauchy-Schwarz; norms raised by 2^-12), plus an absolute 2^-100 for
    underflowing products. An overflowing norm gives +inf: no mass below, no bound above."""
    kf = keys.to(tl.float32)
    k_norm = tl.sqrt(tl.sum(kf * kf, 1)) * 1.000244140625
    return (k_norm[:, None] * q_norm[None, :]) * (2.0 * (D + 8) * 5.9604644775390625e-08
                                                  + 7.62939453125e-06) + 7.888609052210118e-31


@triton.jit
def lowered_mass(s, err, ref, rows, sigma):
    """Per head, the fp64 lower bound ``[BG]`` of Σ e^{σ(q·k − ref)} over the rows ``rows``
    ``[T, BG]`` (scores s ``[T, BG]`` fp32 with error bounds err): each score lowered by its
    error, fp64 exps. NaN terms add 0."""
    x = tl.minimum(sigma * ((s - err).to(tl.float64) - ref[None, :].to(tl.float64)), 700.0)
    return tl.sum(tl.where(rows & (x == x), tl.exp(x), 0.0), 0)


@triton.jit
def raised_mass(s, err, ref, rows, sigma):
    """Per head, an upper bound ``[BG]`` fp64 of Σ e^{σ(q·k − ref)} over the rows ``rows``
    ``[T, BG]`` (at most 256 of them), from fp32 scores raised by their error bounds err: fp32
    exps, the tile's sum times ``MASS_UP``."""
    x = sigma * (s + err - ref[None, :])
    return tl.sum(tl.where(rows, tl.exp(x), 0.0), 0).to(tl.float64) * MASS_UP


@triton.jit
def round_up_f32(x):
    """fp64 ``x`` (>= 0) to an fp32 value at least as large."""
    return (x * 1.0000002384185791).to(tl.float32)  # 1 + 2^-22 over the conversion's 2^-24
