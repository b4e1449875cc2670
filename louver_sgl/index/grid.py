"""Grid codebooks: the w = 1 corner of the bound family.

Per page and KV head each channel d has a range start ``lo_d``, a bin width ``scale_d`` and a
radius ``r_d``; a token stores a b-bit code per channel. The bin center is
``c = lo + (code + 0.5) * scale`` (fp32, always evaluated by ``grid_centers``) and the radius is the
largest |k_d − c_d| over the page (fp64, rounded up), so for every token
    q·k ≤ Σ_d q_d·c_d + Σ_d |q_d|·r_d = A + Σ_d (q_d·scale_d)·code_d,
    A = Σ_d q_d·(lo_d + 0.5·scale_d) + Σ_d |q_d|·r_d.
The page bound Σ_d max(q_d·c_min_d, q_d·c_max_d) + Σ_d |q_d|·r_d holds for every token of the page.
"""

from __future__ import annotations

import torch

from .numerics import dot_slack, round_down, round_up


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``codes`` [..., D] uint8 (< 2**bits) into [..., D * bits // 8] uint8, low bits first."""
    per_byte = 8 // bits
    grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte).to(torch.int32)
    shifts = torch.arange(per_byte, dtype=torch.int32, device=codes.device) * bits
    return (grouped << shifts).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``pack_codes``: [..., B] uint8 -> [..., B * 8 // bits] uint8."""
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, dtype=torch.int32, device=packed.device) * bits
    mask = (1 << bits) - 1
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & mask
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte).to(torch.uint8)


def grid_centers(codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Bin centers in fp32. codes [..., P, H, D] uint8; lo, scale [..., H, D] -> [..., P, H, D]."""
    lo32 = lo.to(torch.float32).unsqueeze(-3)
    scale32 = scale.to(torch.float32).unsqueeze(-3)
    return lo32 + (codes.to(torch.float32) + 0.5) * scale32


def build_grid(keys: torch.Tensor, bits: int, meta_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Build grid codebooks for a batch of full pages.

    Args:
        keys: ``[n_pages, P, H_kv, D]`` stored keys (fp32/fp16/bf16).
        bits: code width (2, 4 or 8).
        meta_dtype: storage dtype of lo/scale/radius (the KV dtype).

    Returns a dict with ``lo``, ``scale``, ``radius`` ``[n_pages, H_kv, D]`` (meta_dtype) and
    ``codes`` ``[n_pages, P, H_kv, D * bits // 8]`` uint8.
    """
    x = keys.to(torch.float32)
    levels = (1 << bits)
    lo = round_down(x.amin(dim=1), meta_dtype)
    span = x.amax(dim=1) - lo.to(torch.float32)
    scale = (span / levels).to(meta_dtype)
    scale32 = scale.to(torch.float32)
    safe = torch.where(scale32 > 0, scale32, torch.ones_like(scale32))
    raw = torch.floor((x - lo.to(torch.float32).unsqueeze(1)) / safe.unsqueeze(1))
    raw = torch.nan_to_num(raw, nan=0.0, posinf=levels - 1, neginf=0.0)
    codes = raw.clamp(0, levels - 1).to(torch.uint8)
    centers = grid_centers(codes, lo, scale).to(torch.float64)
    radius = round_up((x.to(torch.float64) - centers).abs().amax(dim=1), meta_dtype)
    return {"lo": lo, "scale": scale, "radius": radius, "codes": pack_codes(codes, bits)}


def grid_query_terms(
    q: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, radius: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-page query terms of the grid bound.

    Args:
        q: ``[n_pages, H_kv, G, D]`` fp32 query rows (G query heads per KV head).
        lo, scale, radius: ``[n_pages, H_kv, D]`` page codebooks.

    Returns ``(weights [n, H_kv, G, D], offset [n, H_kv, G], page_bound [n, H_kv, G])`` fp32 with
    token bound = offset + Σ_d weights_d·code_d; offset and page_bound already include the slack.
    """
    lo32, sc32 = lo.float().unsqueeze(2), scale.float().unsqueeze(2)
    r32 = radius.float().unsqueeze(2)
    qa = q.abs()
    radius_term = (qa * r32).sum(-1)
    weights = q * sc32
    offset = (q * (lo32 + 0.5 * sc32)).sum(-1) + radius_term
    c_min = lo32 + 0.5 * sc32
    c_max = lo32 + ((1 << bits) - 0.5) * sc32
    page_bound = torch.maximum(q * c_min, q * c_max).sum(-1) + radius_term
    magnitude = (qa * (lo32.abs() + (1 << bits) * sc32.abs() + r32)).sum(-1)
    slack = dot_slack(magnitude, 2 * q.shape[-1] + 2)
    return weights, offset + slack, page_bound + slack


def grid_token_bounds(
    codes: torch.Tensor, weights: torch.Tensor, offset: torch.Tensor, bits: int
) -> torch.Tensor:
    """Token upper bounds. codes ``[n, P, H_kv, B]`` uint8 packed; weights ``[n, H_kv, G, D]``;
    offset ``[n, H_kv, G]`` -> ``[n, P, H_kv, G]`` fp32."""
    unpacked = unpack_codes(codes, bits).to(torch.float32)
    return torch.einsum("npkd,nkgd->npkg", unpacked, weights) + offset.unsqueeze(1)
