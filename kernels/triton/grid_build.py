"""Batched grid page build on the GPU (specification: ``louver_sgl.index.grid.build_grid``).

One program per (page, KV head) reads the page's P keys once and writes lo, scale, the packed
codes and the radius. lo and scale equal the torch build's bit for bit (min of stored values is
exact; scale is span / 2^bits rounded to nearest; codes use IEEE division). The radius is
max |k − c| with c = lo + (code + 0.5)·scale evaluated in fp64, where it is exact for fp16/bf16
pages, then rounded *up* into the storage dtype, so it encloses every member with the exact
center. A page with a non-finite key gets an infinite radius: its bounds keep every token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import TritonLaunch

_STORE_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _bf16_from_bits(bits32):
    """bf16 whose bit pattern is the high half of ``bits32`` (int32)."""
    return (bits32 >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _to_store_rn(x, STORE: tl.constexpr):
    """fp32 ``x`` >= 0 (finite or +inf) cast to STORE rounding to nearest even.

    bf16 is rounded on the bits: casts of the CPU interpreter truncate, the GPU's round.
    """
    if STORE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        return _bf16_from_bits(bits + 0x7FFF + ((bits >> 16) & 1))
    else:
        return x.to(STORE)


@triton.jit
def _round_up_to(x, STORE: tl.constexpr):
    """fp64 ``x`` >= 0 (or +inf) cast to STORE rounding towards +inf."""
    y = x.to(tl.float32)
    y = tl.where(y.to(tl.float64) < x, (y.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True), y)
    if STORE == tl.bfloat16:
        bits = y.to(tl.int32, bitcast=True)
        return _bf16_from_bits(bits + tl.where((bits & 0xFFFF) != 0, 0x10000, 0))
    elif STORE == tl.float16:
        z = y.to(tl.float16)
        return tl.where(z.to(tl.float32) < y, (z.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True), z)
    else:
        return y


@triton.jit
def _grid_build_kernel(
    k_ptr, page_ids_ptr, lo_ptr, scale_ptr, radius_ptr, codes_ptr,
    stride_ks, stride_kh, stride_ms, stride_mh, stride_cs, stride_ch,
    P: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
    STORE: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    raw_page = tl.load(page_ids_ptr + i).to(tl.int64)
    page = tl.maximum(raw_page, 0)
    tok = tl.arange(0, P)
    dim = tl.arange(0, D)
    # negative ids are placeholders (fixed-size lists in graph-captured builds): no reads or writes
    live_tok = (raw_page + 0 * tok) >= 0
    live_dim = (raw_page + 0 * dim) >= 0
    slots = page * P + tok
    keys = tl.load(k_ptr + slots[:, None] * stride_ks + h * stride_kh + dim[None, :],
                   mask=live_tok[:, None], other=0.0).to(tl.float32)
    finite = tl.sum(tl.sum((tl.abs(keys) < float("inf")).to(tl.int32), 1), 0) == P * D
    levels: tl.constexpr = 1 << BITS
    lo = tl.min(keys, 0)  # a stored value: exact in STORE
    span = tl.max(keys, 0) - lo
    scale = _to_store_rn(span / levels, STORE)
    scale32 = scale.to(tl.float32)
    safe = tl.where(scale32 > 0, scale32, 1.0)
    raw = tl.floor(tl.math.div_rn(keys - lo[None, :], tl.broadcast_to(safe[None, :], (P, D))))
    raw = tl.where(raw == raw, raw, 0.0)
    codes = tl.minimum(tl.maximum(raw, 0.0), levels - 1.0)
    center = lo.to(tl.float64)[None, :] + (codes.to(tl.float64) + 0.5) * scale32.to(tl.float64)[None, :]
    dev = tl.max(tl.abs(keys.to(tl.float64) - center), 0)
    dev = tl.where(finite, dev, float("inf"))
    meta = page * stride_ms + h * stride_mh + dim
    tl.store(lo_ptr + meta, lo.to(STORE), mask=live_dim)
    tl.store(scale_ptr + meta, scale, mask=live_dim)
    tl.store(radius_ptr + meta, _round_up_to(dev, STORE), mask=live_dim)
    per_byte: tl.constexpr = 8 // BITS
    icodes = codes.to(tl.int32)
    grouped = tl.reshape(icodes, (P, D // per_byte, per_byte))
    shifts = tl.arange(0, per_byte) * BITS
    packed = tl.sum(grouped << shifts[None, None, :], 2)
    byte = tl.arange(0, D // per_byte)
    tl.store(codes_ptr + slots[:, None] * stride_cs + h * stride_ch + byte[None, :], packed.to(tl.uint8),
             mask=live_tok[:, None])


def grid_build(
    k_cache: torch.Tensor,
    page_ids: torch.Tensor,
    lo: torch.Tensor,
    scale: torch.Tensor,
    radius: torch.Tensor,
    codes: torch.Tensor,
    page_size: int,
    bits: int,
    launch: TritonLaunch = TritonLaunch(),
) -> None:
    """Build the grid index of pages ``page_ids`` in place.

    Args:
        k_cache: ``[num_slots, H_kv, D]`` fp16/bf16/fp32 keys (slot = page_id * P + offset),
            last dim contiguous.
        page_ids: ``[n]`` int32/int64 ids of full pages; negative entries are skipped (a fixed-size
            list for CUDA-graph capture).
        lo, scale, radius: ``[num_pages, H_kv, D]`` in k_cache's dtype (written at ``page_ids``).
        codes: ``[num_slots, H_kv, D * bits // 8]`` uint8 (written at the pages' slots).
        page_size, bits: P (power of two) and code width (2, 4 or 8).
    """
    n = page_ids.numel()
    if n == 0:
        return
    h_kv, dim = k_cache.shape[1], k_cache.shape[2]
    if k_cache.dtype not in _STORE_DTYPES or lo.dtype != k_cache.dtype:
        raise ValueError(f"unsupported key/codebook dtypes {k_cache.dtype}/{lo.dtype}")
    if k_cache.stride(2) != 1 or lo.stride(2) != 1 or codes.stride(2) != 1:
        raise ValueError("k_cache, codebooks and codes need a contiguous last dim")
    if lo.stride() != scale.stride() or lo.stride() != radius.stride():
        raise ValueError("lo, scale and radius must share one layout")
    _grid_build_kernel[(n, h_kv)](
        k_cache, page_ids, lo, scale, radius, codes,
        k_cache.stride(0), k_cache.stride(1), lo.stride(0), lo.stride(1), codes.stride(0), codes.stride(1),
        P=page_size, D=dim, BITS=bits,
        STORE=_STORE_DTYPES[k_cache.dtype],
        num_warps=launch.build_warps,
    )
