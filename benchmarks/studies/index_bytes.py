"""Bytes a decode step moves with each index design, on captured traces: the index's reads
against the candidates they save, at equal guarantee.

Per captured decode query (every ``--query-stride``-th) of every captured layer, per design and
policy, summed over KV heads and queries:

* bytes read per step, as a fraction of dense bf16 K+V (4·D bytes per token and KV head): the
  index (codes and per-page or per-block terms of what the design reads), the K rows of the GQA
  union of candidates, the V rows attended (the budget policy's value gate: exact score at least
  T), the dense part (sink page, recent page, tail: K and V) and the sample's K rows, each part
  also alone (``bytes_by_part``: ``PARTS``; ``codes`` is the first plane of a split design);
* the same bytes with each plane's reads counted in whole 32-byte sectors
  (``bytes_fraction_sectors``: a plane stores a page's tokens one after another, and a read token
  costs every sector its bytes touch, as a GPU reads memory; every other part is read in whole
  rows or pages already);
* for designs with planes or tiers, the share of tokens (union of the group) that read past the
  first one and of 16-token blocks holding any (``past_first_tokens``, ``past_first_blocks16``:
  whether a SIMD scan over 16-token blocks could skip the later bits);
* recall of {exact fp64 score ≥ T} (must be exactly 1.0; the study fails otherwise);
* kept over oracle: union candidates over the oracle's union (budget: the keys whose exact score
  reaches T; certified: the fewest highest-scoring keys whose complement's true mass is ≤ ε·Z).

Designs (all sound in floating point; design notes, "Index designs by bytes moved"):

* ``grid{8,4}-p{64,128}``: today's grid, the kernels' int8 token bounds; ``grid8r-p128`` with
  the compiled CPU step's residual int8 weights (a second integer dot per token);
* ``tier{B}-grid8-p64``: a per-block channel min/max (fp16, rounded outward) over blocks of B
  tokens bounds each block; the 8-bit codes are read only for blocks whose bound reaches T;
* ``split{a}+{b}(+...)-p{64,128}``: the 8-bit grid's codes stored as bit planes (high bits
  first); a prefix of planes bounds each token by its cell (e.g. the high nibble: center
  lo + (16·hi + 8)·scale, half-width 7.5·scale + radius), and the next plane is read only for
  tokens whose bound so far reaches the gate, the last giving the 8-bit bound; certified steps
  count a token below the gate's lowest level by its bound so far (as a one-pass kernel would:
  ``triton_tiled``'s window from the safe level); a final ``r``: the last plane's bound with
  residual int8 weights, as ``grid8r``;
* ``alloc{n}-p128``, ``allocq{n}-p128``, ``allocq9r-p128``: the 8-bit codes' bits read in n tiers
  (``ALLOC_TIERS``: 9 tiers at 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8 bits per channel on average; 6 at 1.5,
  2.5, 4, 6, 7, 8), each page giving a tier's bits to the channels whose cells they shrink most
  (``allocate_low_bits``): weighted by the page's grid steps alone, or (``q``) by them times the
  mean |q_d| per KV head calibrated on *another* trace's queries; ``r``: the last tier with
  residual int8 weights;
* ``lowrank{r}-p64``: per (layer, KV head) a projection P (the top-r eigenvectors of the keys'
  second moment, calibrated on *another* trace) with an 8-bit grid over the projected keys and,
  per token, ‖k − PᵀPk‖ and ‖P(k − PᵀPk)‖ + ‖Pk − k̃‖ rounded up (fp16), so that
  q·k ≤ bound_grid(Pq, k̃) + ‖q − PᵀPq‖·‖k − PᵀPk‖ + ‖Pq‖·δ_k for any P.

Policies: budget 5 % (T from the sample's quantile: the same for every design) and certified
ε = 1e-2 / 1e-3 (the histogram rule on each design's bounds: units are pages, or blocks).

    python -m benchmarks.studies.index_bytes --traces data/traces/bible_8192.pt data/traces/bible_32768.pt \\
        data/traces/paul_graham_8192.pt data/traces/paul_graham_32768.pt --out benchmarks/results/index_bytes.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.record import stamped
from benchmarks.studies.certified_oracle import oracle_keep
from louver_eval.data.paged import load_trace
from louver_sgl import LouverConfig, PageIndexStore
from louver_sgl.decode import threshold as th
from louver_sgl.decode.plan import _sample_positions, split_pages
from louver_sgl.decode.reference_compiled import int8_token_bounds_reference
from louver_sgl.index.bound_designs import (
    allocate_low_bits, block_minmax, block_minmax_bounds, calibrate_channel_weights, calibrate_projection,
    lowrank_bounds, lowrank_terms, nibble_coarse_bounds, project_queries,
)
from louver_sgl.index.grid import unpack_codes

# the designs the kernels run today in the shipped profiles (GPU: 8-bit, page 64; every CPU profile,
# fp16 and fp32, since the 2026-12-05/06 re-tunings: 8-bit, page 128)
SHIPPED = {"grid8-p64": ["gpu (nvidia_h200.json, defaults)"],
           "grid8-p128": ["cpu (cpu_amd_epyc_avx2, cpu_amd_epyc_avx512, cpu_intel_r_xeon_r_processor_avx512)"]}
POLICIES = (("budget0.05", None), ("certified1e-2", 1e-2), ("certified1e-3", 1e-3))
SECTOR = 32  # bytes: the smallest unit a GPU reads from memory (a CPU cache line is 64)


@dataclass
class Bounds:
    """One design's bounds of one query's indexed tokens: unit bounds ``[U, H]`` (pages or
    blocks of ``unit`` tokens) and token bounds ``[U, unit, H]`` fp32/fp64, and its byte costs."""

    unit_bound: torch.Tensor
    token_bound: torch.Tensor
    unit: int
    index_bytes_per_unit: float  # read for every unit (its bound's terms)
    code_bytes_per_token: float  # read only for tokens of units some head keeps
    extra_bytes_per_read_unit: float = 0.0  # e.g. a page's grid terms, read where a unit inside it survives
    units_per_extra: int = 1


def grid_store(keys, page_size: int, bits: int, idx) -> PageIndexStore:
    """The grid index of ``keys``' first ``idx.stop`` pages (``bits``-bit codes, page ``page_size``)."""
    store = PageIndexStore(LouverConfig(page_size=page_size, grid_bits=bits), idx.stop + 1, keys.shape[1],
                           keys.shape[2], keys.dtype)
    store.build_pages(keys[: idx.stop * page_size], torch.arange(idx.stop))
    return store


def grid_bounds(keys, q, page_size: int, bits: int, idx, residual: bool = False,
                store: PageIndexStore | None = None) -> Bounds:
    """Today's grid (int8 token bounds, as the kernels gate; ``residual``: with the compiled CPU
    step's residual int8 weights, ``CpuLaunch.residual_weights``); ``store``: ``grid_store`` of the
    same keys, page size and bits, when the caller has it."""
    h_kv, dim = keys.shape[1], keys.shape[2]
    pages = idx.stop - idx.start
    store = store or grid_store(keys, page_size, bits, idx)
    ids = torch.arange(idx.start, idx.stop)
    groups = q.shape[0] // h_kv
    rows = q.float().view(1, h_kv, groups, dim).expand(pages, -1, -1, -1).contiguous()
    b = store.page_bounds(rows, ids)
    tok = int8_token_bounds_reference(*b.terms, store.page_codes(ids), bits, residual=residual)
    pb = b.page_bound.reshape(pages, -1)
    return Bounds(pb, torch.minimum(tok.reshape(pages, page_size, -1), pb[:, None]), page_size,
                  index_bytes_per_unit=3 * dim * 2, code_bytes_per_token=dim * bits / 8)


@dataclass
class GridPages:
    """What the tiered designs read of an 8-bit grid's indexed pages: the page terms lo, scale,
    radius ``[pages, H_kv, D]`` and the unpacked codes ``[pages, P, H_kv, D]``."""

    lo: torch.Tensor
    scale: torch.Tensor
    radius: torch.Tensor
    codes: torch.Tensor

    @classmethod
    def of(cls, store: PageIndexStore, idx) -> "GridPages":
        ids = torch.arange(idx.start, idx.stop)
        t = store.tensors
        return cls(t["lo"][ids], t["scale"][ids], t["radius"][ids], unpack_codes(store.page_codes(ids), 8))


def split_bounds(q, pages: GridPages, grid: Bounds, planes: tuple[int, ...] = (4, 4)) -> Bounds:
    """The 8-bit grid's codes stored as bit planes of widths ``planes`` (high bits first): each
    prefix of planes bounds a token by its cell (``bound_designs.nibble_coarse_bounds``); a step
    reads the next plane only for tokens whose bound so far reaches the gate, and the last gives
    ``grid``'s 8-bit bound. ``prefixes`` holds the bounds after each plane but the last."""
    dim = pages.scale.shape[-1]
    read = [sum(planes[: i + 1]) for i in range(len(planes))]  # high bits per channel after each plane
    return _tiered_bounds(q, pages, grid, [8 - r for r in read[:-1]], [dim * r for r in read], extra_unit_bytes=0.0)


def alloc_bounds(q, pages: GridPages, grid: Bounds, weight: torch.Tensor, tiers: tuple[float, ...]) -> Bounds:
    """The 8-bit grid's code bits read in tiers of ``tiers`` bits per channel on average (the last 8),
    each page giving its bits to the channels where they tighten the bound most
    (``bound_designs.allocate_low_bits`` with ``weight`` ``[H_kv, D]``: ones, or the calibrated
    mean |q_d|); the last tier gives ``grid``'s 8-bit bound. The allocation is a function of the
    page's stored steps and the per-model weights; the study counts D/2 bytes per page and KV head
    for it all the same (a 4-bit count per channel)."""
    dim = pages.scale.shape[-1]
    budgets = [round(b * dim) for b in tiers]
    return _tiered_bounds(q, pages, grid, allocate_low_bits(pages.scale, weight, budgets[:-1]), budgets,
                          extra_unit_bytes=dim / 2)


def _tiered_bounds(q, pages: GridPages, grid: Bounds, lows, bits_read, extra_unit_bytes: float) -> Bounds:
    """Bounds of a design that reads the 8-bit codes' bits in tiers: ``lows`` (per tier but the
    last, the unread low bits: an int, or ``[pages, H_kv, D]``), ``bits_read`` (bits per token
    read after each tier, the last 8·D)."""
    n, page_size, h_kv, dim = pages.codes.shape
    qg = q.view(h_kv, q.shape[0] // h_kv, dim)
    prefixes = []
    for low in lows:
        u = nibble_coarse_bounds(qg, pages.lo, pages.scale, pages.radius, pages.codes,
                                 low_bits=low).reshape(n, page_size, -1)
        prefixes.append(torch.minimum(torch.minimum(u, grid.unit_bound.double()[:, None]),
                                      prefixes[-1] if prefixes else u))
    bound = Bounds(grid.unit_bound, torch.minimum(grid.token_bound.double(), prefixes[-1]), page_size,
                   index_bytes_per_unit=3 * dim * 2 + extra_unit_bytes, code_bytes_per_token=bits_read[0] / 8)
    bound.prefixes = prefixes
    bound.plane_bytes = [(b - a) / 8 for a, b in zip(bits_read, bits_read[1:])]
    bound.coarse = prefixes[0]
    return bound


def tier_bounds(keys, q, block: int, idx, grid: Bounds, page_size: int = 64) -> Bounds:
    """Blocks of ``block`` tokens with a per-channel min/max (fp16, rounded outward) in front of
    the 8-bit grid ``grid`` (its bounds of the same query): units are blocks; a block's codes
    (and its page's grid terms) are read only where its bound reaches T."""
    h_kv, dim = keys.shape[1], keys.shape[2]
    groups = q.shape[0] // h_kv
    lo, hi = block_minmax(keys[idx.start * page_size: idx.stop * page_size], block)
    nb = lo.shape[0]
    bound = block_minmax_bounds(q.view(h_kv, groups, dim), lo, hi)
    block_bound = bound.reshape(nb, -1)
    tok = grid.token_bound.reshape(nb, block, -1).double()
    return Bounds(block_bound, torch.minimum(tok, block_bound[:, None]), block, index_bytes_per_unit=2 * dim * 2,
                  code_bytes_per_token=dim, extra_bytes_per_read_unit=3 * dim * 2, units_per_extra=page_size // block)


def lowrank_design(keys, q, proj: torch.Tensor, idx, page_size: int = 64) -> Bounds:
    """The low-rank design (``bound_designs.lowrank_bounds``): an 8-bit grid over k̃ and per
    token ‖k_R‖ and δ_k in fp16."""
    h_kv, dim = keys.shape[1], keys.shape[2]
    rank = proj.shape[1]
    groups = q.shape[0] // h_kv
    kt, r_k, delta = lowrank_terms(keys[: idx.stop * page_size], proj)
    low = grid_bounds(kt, project_queries(q.view(h_kv, groups, dim), proj).reshape(q.shape[0], -1), page_size, 8, idx)
    n0, n1 = idx.start * page_size, idx.stop * page_size
    pages = idx.stop - idx.start
    tok = lowrank_bounds(q.view(h_kv, groups, dim), proj, low.token_bound.reshape(-1, h_kv, groups), kt[n0:n1],
                         r_k[n0:n1], delta[n0:n1]).reshape(pages, page_size, -1)
    page = torch.maximum(low.unit_bound.double(), tok.amax(1))  # at least every token's bound
    return Bounds(page, torch.minimum(tok, page[:, None]), page_size, index_bytes_per_unit=3 * rank * 2 + 4,
                  code_bytes_per_token=rank + 4)


PARTS = ("unit_terms", "codes", "planes", "k_rows", "v_rows", "dense_part", "sample")


def step_bytes(b: Bounds, keep_unit, union, scores_idx, t, dense_tokens, n_tokens, sample, dim, groups):
    """Bytes of one query's step over all KV heads by part (``PARTS``; "planes" is left to the
    caller), and the dense bf16 K+V bytes. union ``[n_idx, H_kv]``; scores_idx ``[n_idx, H_q]``;
    t ``[H_q]`` (the value gate's T; None: every union row's V is read)."""
    h = keep_unit.shape[1]
    h_kv = h // groups
    row = 2 * dim  # one bf16 K or V row
    read_unit = keep_unit.view(-1, h_kv, groups).any(-1)  # [U, H_kv]
    units = keep_unit.shape[0]
    unit_terms = units * h_kv * b.index_bytes_per_unit
    codes = float(read_unit.sum()) * b.unit * b.code_bytes_per_token
    if b.extra_bytes_per_read_unit:
        pages = read_unit.view(-1, b.units_per_extra, h_kv).any(1)
        unit_terms += float(pages.sum()) * b.extra_bytes_per_read_unit
    k_rows = float(union.sum())
    v_rows = k_rows
    if t is not None:
        gate = th.gate_threshold(t).view(h_kv, groups)
        v_rows = float((union & (scores_idx.view(-1, h_kv, groups) >= gate).any(-1)).sum())
    parts = dict(unit_terms=unit_terms, codes=codes, planes=0.0, k_rows=k_rows * row, v_rows=v_rows * row,
                 dense_part=dense_tokens * h_kv * 2 * row, sample=sample * h_kv * row)
    return parts, n_tokens * h_kv * 2 * row


def measure_query(keys, q, sigma, design: str, bounds: Bounds, idx, page_size: int, sample_size: int) -> dict:
    """Every policy's row of one query and design."""
    n, h_kv, dim = keys.shape
    groups = q.shape[0] // h_kv
    scores = torch.einsum("hd,lhd->hl", q.double(), keys.double().repeat_interleave(groups, 1))  # fp64 [H, n]
    idx_pos = torch.arange(idx.start * page_size, idx.stop * page_size)
    dense = torch.ones(n, dtype=torch.bool)
    dense[idx_pos] = False
    sample = idx_pos[_sample_positions(len(idx_pos), sample_size)]
    known = dense.clone()
    known[sample] = True
    s32 = scores.float()
    ref = torch.where(known, s32, -math.inf).amax(1)
    mass = torch.exp(th.log_mass(scores, ref[:, None], sigma).clamp(max=700.0))
    z_lb = (mass * known).sum(1)
    z_true = mass.sum(1)
    s_idx = scores[:, idx_pos]  # [H, n_idx]
    out = {}
    for policy, eps in POLICIES:
        if eps is None:
            t = th.budget_threshold(s32[:, sample].t()[None], torch.tensor([len(sample)]), 0.05)[0]
        else:
            token_bound = bounds.token_bound
            prefixes = getattr(bounds, "prefixes", None)
            if prefixes is not None:  # a plane is read only at or above the window's lowest level
                t_lo = _window_floor(ref, z_lb, len(idx_pos), sigma, eps)
                token_bound = bounds.token_bound
                for prefix in reversed(prefixes):
                    token_bound = torch.where(prefix >= t_lo, token_bound, prefix)
            page_req = torch.zeros(bounds.unit_bound.shape[0], dtype=torch.long)
            t = th.certified_choice(bounds.unit_bound.float(), token_bound.float(), page_req, ref[None],
                                    z_lb[None], sigma, eps * th.BUDGET_SAFETY, th.HIST_ROUNDING)[0][0]
        keep_unit = ~(bounds.unit_bound < t)  # [U, H]
        keep_tok = keep_unit[:, None] & ~(bounds.token_bound < t)  # [U, unit, H]
        plane_reads = []  # (tokens reading a plane, its bytes): where the bound so far reaches T
        for prefix, nbytes in zip(getattr(bounds, "prefixes", []), getattr(bounds, "plane_bytes", [])):
            plane_reads.append(((keep_unit[:, None] & ~(prefix < t)).reshape(-1, keep_tok.shape[-1]), nbytes))
        keep = keep_tok.reshape(-1, keep_tok.shape[-1]).t()  # [H, n_idx]
        union = keep.view(h_kv, groups, -1).any(1)  # [H_kv, n_idx]
        reach = ~(s_idx < t.double()[:, None])
        recall_ok = bool((keep | ~reach).all())
        if eps is None:
            oracle = reach.view(h_kv, groups, -1).any(1)
        else:
            c = dict(m_idx=mass[:, idx_pos], z_true=z_true)
            oracle = oracle_keep(c, eps).t().reshape(h_kv, groups, -1).any(1)
        parts, dense_bytes = step_bytes(bounds, keep_unit, union.t(), s_idx.t().float(),
                                        t if eps is None else None, float(dense.sum()), n, len(sample), dim, groups)
        plane_sectors, past_first = 0.0, [0.0, 0.0, 0.0, 0.0]
        for i, (reads, nbytes) in enumerate(plane_reads):
            tokens = reads.view(-1, h_kv, groups).any(-1)  # [n_idx, H_kv]
            parts["planes"] += float(tokens.sum()) * nbytes
            plane_sectors += sector_bytes(tokens.view(-1, bounds.unit, h_kv), nbytes)
            if i == 0:  # past the first tier: tokens, and 16-token blocks with any (a SIMD scan's unit)
                blocks = tokens.view(-1, 16, h_kv).any(1)
                past_first = [float(tokens.sum()), tokens.numel(), float(blocks.sum()), blocks.numel()]
        out[policy] = dict(parts=parts, dense=dense_bytes, kept=int(union.sum()), oracle=int(oracle.sum()),
                           recall_ok=recall_ok, plane_sectors=plane_sectors, past_first=past_first)
    return out


def sector_bytes(tokens: torch.Tensor, nbytes: float, sector: int = SECTOR) -> float:
    """Bytes a plane's reads touch in whole ``sector``-byte sectors: each unit (page) stores the
    plane token after token (``nbytes`` per token), and a read token touches every sector its
    bytes overlap. tokens ``[U, unit, H_kv]`` bool (the tokens that read the plane)."""
    units, unit, h_kv = tokens.shape
    start = torch.arange(unit, dtype=torch.float64) * nbytes
    first = torch.div(start, sector, rounding_mode="floor").long()
    last = torch.div(start + nbytes - 1, sector, rounding_mode="floor").long()
    touched = torch.zeros(units, int(last[-1]) + 1, h_kv, dtype=torch.int32)
    for offset in range(int((last - first).max()) + 1):
        sec = torch.minimum(first + offset, last)  # [unit]: the offset-th sector of each token (capped)
        touched.index_add_(1, sec, tokens.int())
    return float((touched > 0).sum()) * sector


def _window_floor(ref, z_lb, n_idx: int, sigma: float, eps: float, start: int = 4) -> torch.Tensor:
    """Per head the threshold at the safe level's edge plus ``start`` edges: the lowest level a
    one-pass certified step (``triton_tiled``) refines bounds at."""
    level = torch.log(eps * th.BUDGET_SAFETY * z_lb / max(n_idx, 1))
    edge = ((level - th.EDGE_LOW) / th.EDGE_STEP).floor().clamp(-1, th.EDGE_COUNT - 1).long() + start
    return th.edge_threshold(edge.clamp(min=0), ref, sigma)


# bit-plane splits of the 8-bit codes studied, per page size (high bits first)
SPLITS = {64: ((4, 4), (2, 2, 4), (3, 5)),
          128: ((4, 4), (2, 2, 4), (1, 1, 2, 4), (2, 3, 3), (2, 1, 1, 4), (2, 2, 2, 2), (2, 1, 1, 2, 2),
                (2, 1, 1, 1, 1, 1, 1))}
RESIDUAL_SPLITS = ((2, 2, 4), (2, 1, 1, 4))  # page 128, the last plane bounded with residual int8 weights
# the allocated designs' tiers, by their count: bits per channel read on average after each (the last: all 8)
ALLOC_TIERS = {9: (1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0), 6: (1.5, 2.5, 4.0, 6.0, 7.0, 8.0)}
# page 128: (name, tiers, calibrated weights, last tier with residual int8 weights)
ALLOCS = (("alloc9-p128", 9, False, False), ("allocq9-p128", 9, True, False), ("allocq9r-p128", 9, True, True),
          ("allocq6-p128", 6, True, False))


def split_name(planes: tuple[int, ...], page: int, residual: bool = False) -> str:
    """``split2+2+4-p128``; ``r`` before the page size: the last plane with residual weights."""
    return f"split{'+'.join(map(str, planes))}{'r' if residual else ''}-p{page}"


def design_names(ranks) -> list[str]:
    """Every design the study measures, in table order."""
    names = [f"grid{bits}-p{page}" for bits in (8, 4) for page in (64, 128)] + ["grid8r-p128"]
    names += [split_name(planes, page) for page, splits in SPLITS.items() for planes in splits]
    names += [split_name(planes, 128, residual=True) for planes in RESIDUAL_SPLITS]
    names += [name for name, *_ in ALLOCS]
    names += [f"tier{block}-grid8-p64" for block in (8, 16, 32)]
    return names + [f"lowrank{rank}-p64" for rank in ranks]


def designs_for(keys, q, idx64, idx128, projections: dict, weights: torch.Tensor,
                wanted=None) -> dict[str, tuple[Bounds, range, int]]:
    """The designs named in ``wanted`` (default: all), each as (bounds, indexed pages, page size);
    a split, allocated or tier design builds the 8-bit grid of its page size for its last tier.
    ``weights`` ``[H_kv, D]``: the calibrated channel weights of the ``allocq`` designs."""
    wanted = set(design_names(projections) if wanted is None else wanted)
    idx = {64: idx64, 128: idx128}
    grids: dict[tuple[int, int, bool], Bounds] = {}
    stores: dict[tuple[int, int], PageIndexStore] = {}  # one index per (bits, page) for every design
    planes: dict[int, GridPages] = {}

    def store(bits: int, page: int) -> PageIndexStore:
        if (bits, page) not in stores:
            stores[bits, page] = grid_store(keys, page, bits, idx[page])
        return stores[bits, page]

    def grid(bits: int, page: int, residual: bool = False) -> Bounds:
        if (bits, page, residual) not in grids:
            grids[bits, page, residual] = grid_bounds(keys, q, page, bits, idx[page], residual, store(bits, page))
        return grids[bits, page, residual]

    def pages8(page: int) -> GridPages:
        if page not in planes:
            planes[page] = GridPages.of(store(8, page), idx[page])
        return planes[page]

    out = {}
    for bits in (8, 4):
        for page in (64, 128):
            if f"grid{bits}-p{page}" in wanted:
                out[f"grid{bits}-p{page}"] = (grid(bits, page), idx[page], page)
    if "grid8r-p128" in wanted:
        out["grid8r-p128"] = (grid(8, 128, True), idx128, 128)
    splits = [(widths, page, False) for page, by_page in SPLITS.items() for widths in by_page]
    for widths, page, residual in splits + [(widths, 128, True) for widths in RESIDUAL_SPLITS]:
        name = split_name(widths, page, residual)
        if name in wanted:
            out[name] = (split_bounds(q, pages8(page), grid(8, page, residual), widths), idx[page], page)
    for name, tiers, calibrated, residual in ALLOCS:
        if name in wanted:
            weight = weights if calibrated else torch.ones_like(weights)
            out[name] = (alloc_bounds(q, pages8(128), grid(8, 128, residual), weight, ALLOC_TIERS[tiers]), idx128, 128)
    for block in (8, 16, 32):
        if f"tier{block}-grid8-p64" in wanted:
            out[f"tier{block}-grid8-p64"] = (tier_bounds(keys, q, block, idx64, grid(8, 64)), idx64, 64)
    for rank, proj in projections.items():
        if f"lowrank{rank}-p64" in wanted:
            out[f"lowrank{rank}-p64"] = (lowrank_design(keys, q, proj, idx64), idx64, 64)
    return out


def measure_trace(path: Path, calibration: Path, ranks, stride: int, wanted=None) -> dict:
    trace, calib = load_trace(path), load_trace(calibration)
    sigma = float(trace["meta"]["softmax_scale"])
    totals: dict[tuple[str, str], dict] = {}
    for layer in sorted(trace["keys"]):
        keys, queries = trace["keys"][layer], trace["queries"][layer]
        projections = {r: calibrate_projection(calib["keys"][layer], r) for r in ranks
                       if wanted is None or f"lowrank{r}-p64" in wanted}
        weights = calibrate_channel_weights(calib["queries"][layer], keys.shape[1])
        for qi, pos in list(enumerate(trace["query_positions"].tolist()))[::stride]:
            k = keys[: pos + 1]
            idx64 = split_pages(pos + 1, LouverConfig(page_size=64))[1]
            idx128 = split_pages(pos + 1, LouverConfig(page_size=128))[1]
            for design, (bounds, idx, page) in designs_for(k, queries[qi], idx64, idx128, projections, weights, wanted).items():
                for policy, r in measure_query(k, queries[qi], sigma, design, bounds, idx, page, 256).items():
                    acc = totals.setdefault((design, policy), dict(parts=dict.fromkeys(PARTS, 0.0), dense=0.0, kept=0,
                                                                   oracle=0, recall=True, plane_sectors=0.0,
                                                                   past_first=[0.0, 0.0, 0.0, 0.0]))
                    for part, nbytes in r["parts"].items():
                        acc["parts"][part] += nbytes
                    acc["dense"] += r["dense"]
                    acc["kept"] += r["kept"]
                    acc["oracle"] += r["oracle"]
                    acc["recall"] &= r["recall_ok"]
                    acc["plane_sectors"] += r["plane_sectors"]
                    acc["past_first"] = [a + b for a, b in zip(acc["past_first"], r["past_first"])]
    return totals


def _past_first(sums) -> dict:
    """The share of indexed tokens (union of the group) that read past a design's first plane or
    tier, and of 16-token blocks holding any: None for designs without planes."""
    tokens, n_tokens, blocks, n_blocks = sums
    return dict(past_first_tokens=tokens / n_tokens if n_tokens else None,
                past_first_blocks16=blocks / n_blocks if n_blocks else None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", nargs="+", required=True)
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--query-stride", type=int, default=4, help="every n-th captured query")
    parser.add_argument("--designs", nargs="+", default=None, help="only these designs (default: all)")
    parser.add_argument("--out", default="benchmarks/results/index_bytes.json")
    args = parser.parse_args()
    unknown = set(args.designs or []) - set(design_names(args.ranks))
    if unknown:
        parser.error(f"unknown designs {sorted(unknown)}; known: {design_names(args.ranks)}")
    rows, start = [], time.time()
    for path in map(Path, args.traces):
        other = [Path(t) for t in args.traces if Path(t).name.split("_")[0] != path.name.split("_")[0]]
        calibration = other[0] if other else path  # projections and channel weights come from another text
        totals = measure_trace(path, calibration, args.ranks, args.query_stride, args.designs)
        for (design, policy), acc in totals.items():
            moved = sum(acc["parts"].values())
            rows.append(dict(design=design, trace=path.stem, policy=policy, bytes_fraction=moved / acc["dense"],
                             recall=1.0 if acc["recall"] else 0.0, kept_over_oracle=acc["kept"] / max(acc["oracle"], 1),
                             shipped=design in SHIPPED, shipped_on=SHIPPED.get(design, []),
                             calibrated_on=calibration.stem if design.startswith(("lowrank", "allocq")) else None,
                             bytes_by_part={k: v / acc["dense"] for k, v in acc["parts"].items()},
                             bytes_fraction_sectors=(moved - acc["parts"]["planes"] + acc["plane_sectors"]) / acc["dense"],
                             **_past_first(acc["past_first"])))
            print(json.dumps(rows[-1]), flush=True)
        print(f"[index_bytes] {path}: done ({time.time() - start:.0f} s)", file=sys.stderr, flush=True)
    Path(args.out).write_text(json.dumps(stamped({"config": vars(args), "rows": rows}), indent=1) + "\n")
    bad = [r for r in rows if r["recall"] != 1.0]
    if bad:
        print(f"recall below 1.0: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
