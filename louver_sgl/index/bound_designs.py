"""Index designs studied against the grid by the bytes a step moves (``benchmarks/studies/
index_bytes.py``; design notes, "Index designs by bytes moved"): plain-torch references of their
bounds, fp64, each an upper bound of q·k for every key it covers in floating point too.

* ``nibble_coarse_bounds``: the 8-bit grid's codes read as bit planes; the high bits alone give
  a coarser cell per channel (the same count of bits for every channel, or per channel as
  ``allocate_low_bits`` gives them out);
* ``block_minmax_bounds``: a per-channel min/max over a block of tokens, stored in fp16 rounded
  outward;
* ``lowrank_bounds``: a projection P of the keys with a grid over the projected keys and a
  residual norm per token.

A NaN or infinite key makes its bound NaN or +inf (keep); ties keep (callers compare ``~(u < T)``).
"""

from __future__ import annotations

import math

import torch

FP16_MAX = 65504.0
_U32 = 2.0 ** -24  # fp32 unit roundoff
_SUM64 = 1e-13  # covers the fp64 rounding of a sum of <= 10^3 terms, relative to Σ|terms|


def nibble_coarse_bounds(q: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, radius: torch.Tensor,
                         codes: torch.Tensor, bits: int = 8, low_bits: int | torch.Tensor = 4) -> torch.Tensor:
    """Bounds from the high ``bits − low_bits`` bits of each code alone.

    A token's b-bit code c lies in [h·2^l, h·2^l + 2^l − 1] for its high part h = c >> l, so its
    grid center lo + (c + 0.5)·scale (evaluated in fp32, within 2^-23·(|lo| + 2^b·|scale|) of the
    exact one) lies within (2^l − 1)/2·|scale| of lo + (h·2^l + 2^l/2)·scale, and the key within
    the page's radius of its center.

    q ``[H_kv, G, D]``; lo, scale, radius ``[n, H_kv, D]`` (one page per row); codes ``[n, P, H_kv,
    D]`` unpacked b-bit codes -> ``[n, P, H_kv, G]`` fp64. ``low_bits`` (the unread low bits l, 0..b):
    one count for every channel, or one per page, KV head and channel ``[n, H_kv, D]`` (an
    allocation, ``allocate_low_bits``): the bound holds channel by channel, for any l.
    """
    lo, scale, radius, q = lo.double(), scale.double(), radius.double(), q.double()
    low = torch.broadcast_to(torch.as_tensor(low_bits, dtype=torch.long), scale.shape)
    if bool(((low < 0) | (low > bits)).any()):
        raise ValueError(f"low_bits must lie in [0, {bits}]")
    cell = torch.pow(2.0, low.double())  # [n, H_kv, D]
    high = torch.bitwise_right_shift(codes.long(), low[:, None]).double()
    center = lo[:, None] + (high * cell[:, None] + cell[:, None] / 2) * scale[:, None]  # [n, P, H_kv, D]
    half = (cell - 1) / 2 * scale.abs() + radius + 2.0 ** -23 * (lo.abs() + (1 << bits) * scale.abs())
    dots = torch.einsum("npkd,kgd->npkg", center, q)
    widths = torch.einsum("nkd,kgd->nkg", half, q.abs())[:, None]
    magnitude = torch.einsum("npkd,kgd->npkg", center.abs(), q.abs()) + widths
    return dots + widths + magnitude * _SUM64


def allocate_low_bits(scale: torch.Tensor, weight: torch.Tensor, budgets, bits: int = 8) -> list[torch.Tensor]:
    """Per page, KV head and channel, the low bits a tier leaves unread: the first ``budgets[i]``
    bits per token go, one at a time, to the channel whose next bit shrinks Σ_d weight_d·|s_d|·2^l_d
    the most (the cell half-widths the bound adds, weighted), high bits first.

    A bit of channel d at position l (l = b for the top bit) halves a cell of 2^l steps: its gain
    is weight_d·|s_d|·2^(l−2), so sorting every (channel, bit) by log2(weight_d·|s_d|) + l gives
    each channel's bits high to low and nested tiers (tier i + 1 reads tier i's bits and more).
    Any allocation keeps ``nibble_coarse_bounds`` sound; this one makes it tight where the query
    and the page's spread are large. Zero or non-finite spreads sort last.

    scale ``[n, H_kv, D]`` (the page's grid steps); weight ``[H_kv, D]`` ≥ 0 (``calibrate_channel_
    weights``, or ones); budgets: increasing bits per token, each ≤ b·D -> one ``[n, H_kv, D]``
    long tensor of unread low bits per budget."""
    n, h_kv, dim = scale.shape
    if weight.shape != (h_kv, dim):
        raise ValueError(f"weight must be [{h_kv}, {dim}], got {list(weight.shape)}")
    budgets = list(budgets)
    if any(b < 0 or b > bits * dim for b in budgets) or budgets != sorted(budgets):
        raise ValueError(f"budgets must increase within [0, {bits * dim}], got {budgets}")
    spread = torch.log2(scale.double().abs() * weight.double().clamp(min=0)[None])
    spread = torch.where(torch.isfinite(spread), spread, -math.inf)
    position = torch.arange(bits, 0, -1, dtype=torch.float64)
    key = (spread[..., None] + position).reshape(n, h_kv, dim * bits)
    channel = torch.sort(key, dim=-1, descending=True, stable=True).indices // bits
    out = []
    for budget in budgets:
        read = torch.zeros(n, h_kv, dim, dtype=torch.long)
        read.scatter_add_(2, channel[..., :budget], torch.ones_like(channel[..., :budget]))
        out.append(bits - read)
    return out


def calibrate_channel_weights(queries: torch.Tensor, h_kv: int) -> torch.Tensor:
    """Per KV head and channel, the mean |q_d| over ``queries`` ``[m, H_q, D]`` and the group's
    query heads: ``[H_kv, D]`` fp32 (``allocate_low_bits``' weights; non-finite queries count 0)."""
    q = queries.double().abs()
    q = torch.where(torch.isfinite(q), q, 0.0)
    _, h_q, dim = q.shape
    return q.mean(0).view(h_kv, h_q // h_kv, dim).mean(1).float()


def round_to_fp16(x: torch.Tensor, down: bool) -> torch.Tensor:
    """``x`` to an fp16 value on the safe side (at most x for ``down``, else at least x), as
    fp64; beyond fp16's range ±inf. NaN stays NaN."""
    x = x.double()
    y = x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    toward = torch.full_like(y, -math.inf if down else math.inf)
    wrong = (y.double() > x) if down else (y.double() < x)
    y = torch.where(wrong, torch.nextafter(y, toward), y).double()
    over = (x < -FP16_MAX) if down else (x > FP16_MAX)
    return torch.where(over, -math.inf if down else math.inf, y)


def block_minmax(keys: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of ``block`` tokens and channel, (min, max) of ``keys`` ``[n, H_kv, D]`` (n a
    multiple of block) in fp16 rounded outward: ``[n / block, H_kv, D]`` fp64 each. A NaN key
    makes its block's min and max NaN."""
    k = keys.double().view(-1, block, *keys.shape[1:])
    nan = torch.isnan(k).any(1)
    lo = torch.where(nan, math.nan, round_to_fp16(k.amin(1), down=True))
    hi = torch.where(nan, math.nan, round_to_fp16(k.amax(1), down=False))
    return lo, hi


def block_minmax_bounds(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Σ_d max(q_d·lo_d, q_d·hi_d) per block: q ``[H_kv, G, D]``, lo/hi ``[nb, H_kv, D]`` ->
    ``[nb, H_kv, G]`` fp64. The products are exact in fp64 (fp16 × fp32 values); the sum errs by
    less than 10^-13 of Σ|terms|."""
    q = q.double()
    terms = torch.maximum(torch.einsum("bkd,kgd->bkgd", lo, q), torch.einsum("bkd,kgd->bkgd", hi, q))
    terms = torch.where(q[None] == 0, 0.0, terms)  # 0·inf: the channel adds nothing
    return terms.sum(-1) + terms.abs().sum(-1) * _SUM64


def calibrate_projection(keys: torch.Tensor, rank: int) -> torch.Tensor:
    """P ``[H_kv, r, D]`` fp32: per KV head the top-``rank`` eigenvectors of Σ k·kᵀ over
    ``keys`` ``[n, H_kv, D]`` (any P keeps the bound sound; this one makes its residuals small)."""
    k = keys.double()
    k = torch.where(torch.isfinite(k), k, 0.0)
    _, vecs = torch.linalg.eigh(torch.einsum("nhd,nhe->hde", k, k))
    return vecs[..., -rank:].transpose(1, 2).float().contiguous()


def lowrank_terms(keys: torch.Tensor, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a low-rank index stores per token: (k̃ = fp32(P·k) ``[n, H_kv, r]``, ‖k_R‖ and
    δ = ‖P·k_R‖ + ‖P·k − k̃‖ ``[n, H_kv]`` rounded up to fp16), k_R = k − PᵀP·k in fp64."""
    k64, p64 = keys.double(), proj.double()
    kt = torch.einsum("hrd,nhd->nhr", proj, keys.float())
    pk = torch.einsum("hrd,nhd->nhr", p64, k64)
    k_res = k64 - torch.einsum("hrd,nhr->nhd", p64, pk)
    r_k = round_to_fp16(k_res.norm(dim=-1) * (1 + _SUM64), down=False)
    delta = (torch.einsum("hrd,nhd->nhr", p64, k_res).norm(dim=-1) + (pk - kt.double()).norm(dim=-1)) * (1 + _SUM64)
    return kt, r_k, round_to_fp16(delta, down=False)


def lowrank_bounds(q: torch.Tensor, proj: torch.Tensor, projected_bound: torch.Tensor, kt: torch.Tensor,
                   r_k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """q·k ≤ bound(fp32(Pq)·k̃) + ‖q − PᵀPq‖·‖k_R‖ + ‖Pq‖·δ_k + ‖Pq − fp32(Pq)‖·‖k̃‖ for any P:
    q·k = (Pq)·(Pk) + q·k_R, q·k_R = (q − PᵀPq)·k_R + (Pq)·(P k_R), and (Pq)·(Pk) differs from
    fp32(Pq)·k̃ by the last terms.

    q ``[H_kv, G, D]``; proj ``[H_kv, r, D]``; projected_bound ``[n, H_kv, G]``: upper bounds of
    fp32(Pq)·k̃ (a grid index over k̃); kt ``[n, H_kv, r]``; r_k, delta ``[n, H_kv]`` ->
    ``[n, H_kv, G]`` fp64."""
    q64, p64 = q.double(), proj.double()
    pq = torch.einsum("hrd,hgd->hgr", p64, q64)
    q_res = (q64 - torch.einsum("hrd,hgr->hgd", p64, pq)).norm(dim=-1) * (1 + _SUM64)
    pq32 = torch.einsum("hrd,hgd->hgr", proj, q.float()).double()
    q_err = (pq - pq32).norm(dim=-1) * (1 + _SUM64)
    extra = (r_k[..., None] * q_res[None] + delta[..., None] * pq.norm(dim=-1)[None] * (1 + _SUM64)
             + kt.double().norm(dim=-1)[..., None] * (1 + _SUM64) * q_err[None])
    return projected_bound.double() + extra * (1 + _SUM64)


def project_queries(q: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """fp32(P·q) ``[H_kv, G, r]`` of q ``[H_kv, G, D]``: the query the projected index sees."""
    return torch.einsum("hrd,hgd->hgr", proj, q.float())
