"""Bytes a decode step moves with each index design, on captured traces: the index's reads
against the candidates they save, at equal guarantee.

Per captured decode query (every ``--query-stride``-th) of every captured layer, per design and
policy, summed over KV heads and queries:

* bytes read per step, as a fraction of dense bf16 K+V (4·D bytes per token and KV head): the
  index (codes and per-page or per-block terms of what the design reads), the K rows of the GQA
  union of candidates, the V rows attended (the budget policy's value gate: exact score at least
  T), the dense part (sink page, recent page, tail: K and V) and the sample's K rows;
* recall of {exact fp64 score ≥ T} (must be exactly 1.0; the study fails otherwise);
* kept over oracle: union candidates over the oracle's union (budget: the keys whose exact score
  reaches T; certified: the fewest highest-scoring keys whose complement's true mass is ≤ ε·Z).

Designs (all sound in floating point; design notes, "Index designs by bytes moved"):

* ``grid{8,4}-p{64,128}``: today's grid, the kernels' int8 token bounds;
* ``tier{B}-grid8-p64``: a per-block channel min/max (fp16, rounded outward) over blocks of B
  tokens bounds each block; the 8-bit codes are read only for blocks whose bound reaches T;
* ``split4+4-p64``: the 8-bit grid's codes stored as two nibble planes; the high nibbles alone
  bound each token by its 16-level cell (center lo + (16·hi + 8)·scale, half-width 7.5·scale +
  radius), and the low nibbles (the 8-bit bound) are read only for tokens whose coarse bound
  reaches the gate; certified steps count a token below the gate's lowest level by its coarse
  bound (as a one-pass kernel would: ``triton_tiled``'s window from the safe level);
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

# the designs the kernels run today (a grid of 8 or 4 bits; GPU: 8-bit, page 64)
SHIPPED = {"grid8-p64": ["gpu (nvidia_h200.json, defaults)"], "grid4-p128": ["cpu (cpu_amd_epyc_avx2/avx512.json)"],
           "grid4-p64": ["cpu (cpu_amd_epyc_avx2.float32.json)"],
           "grid8-p128": ["cpu (cpu_intel_r_xeon_r_processor_avx512.float32.json)"]}
POLICIES = (("budget0.05", None), ("certified1e-2", 1e-2), ("certified1e-3", 1e-3))
FP16_MAX = 65504.0


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


def grid_bounds(keys, q, page_size: int, bits: int, idx) -> Bounds:
    """Today's grid (int8 token bounds, as the kernels gate)."""
    config = LouverConfig(page_size=page_size, grid_bits=bits)
    h_kv, dim = keys.shape[1], keys.shape[2]
    pages = idx.stop - idx.start
    store = PageIndexStore(config, idx.stop + 1, h_kv, dim, keys.dtype)
    store.build_pages(keys[: idx.stop * page_size], torch.arange(idx.stop))
    ids = torch.arange(idx.start, idx.stop)
    groups = q.shape[0] // h_kv
    rows = q.float().view(1, h_kv, groups, dim).expand(pages, -1, -1, -1).contiguous()
    b = store.page_bounds(rows, ids)
    tok = int8_token_bounds_reference(*b.terms, store.page_codes(ids), bits)
    pb = b.page_bound.reshape(pages, -1)
    return Bounds(pb, torch.minimum(tok.reshape(pages, page_size, -1), pb[:, None]), page_size,
                  index_bytes_per_unit=3 * dim * 2, code_bytes_per_token=dim * bits / 8)


def split_bounds(keys, q, idx, grid: Bounds, page_size: int = 64) -> Bounds:
    """The 8-bit grid read in two nibble planes (module docstring): token bounds are the coarse
    (high-nibble) ones, refined by ``grid``'s 8-bit ones; ``coarse`` marks what a step reads."""
    config = LouverConfig(page_size=page_size, grid_bits=8)
    h_kv, dim = keys.shape[1], keys.shape[2]
    groups = q.shape[0] // h_kv
    store = PageIndexStore(config, idx.stop + 1, h_kv, dim, keys.dtype)
    store.build_pages(keys[: idx.stop * page_size], torch.arange(idx.stop))
    ids = torch.arange(idx.start, idx.stop)
    t = store.tensors
    lo, sc, rad = (t[n][ids].double() for n in ("lo", "scale", "radius"))  # [pages, H_kv, D]
    hi = (store.page_codes(ids).long() >> 4).double()  # [pages, P, H_kv, D]
    center = lo[:, None] + (16 * hi + 8) * sc[:, None]
    half = 7.5 * sc.abs() + rad  # [pages, H_kv, D]
    qh = q.double().view(h_kv, groups, dim)
    dots = torch.einsum("npkd,kgd->npkg", center, qh)
    mags = torch.einsum("npkd,kgd->npkg", center.abs(), qh.abs())
    widths = torch.einsum("nkd,kgd->nkg", half, qh.abs())[:, None]
    # fp64 sums of D exact-ish terms: errs by < 1e-13 of their magnitudes
    coarse = (dots + widths + (mags + widths) * 1e-13).reshape(len(ids), page_size, -1)
    bound = Bounds(grid.unit_bound, torch.minimum(grid.token_bound.double(), coarse), page_size,
                   index_bytes_per_unit=3 * dim * 2, code_bytes_per_token=dim / 2)
    bound.coarse = torch.minimum(coarse, grid.unit_bound.double()[:, None])
    return bound


def tier_bounds(keys, q, block: int, idx, grid: Bounds, page_size: int = 64) -> Bounds:
    """Blocks of ``block`` tokens with a per-channel min/max (fp16, rounded outward) in front of
    the 8-bit grid ``grid`` (its bounds of the same query): units are blocks; a block's codes
    (and its page's grid terms) are read only where its bound reaches T."""
    h_kv, dim = keys.shape[1], keys.shape[2]
    groups = q.shape[0] // h_kv
    k = keys[idx.start * page_size: idx.stop * page_size].double()  # [n, H_kv, D]
    nb = k.shape[0] // block
    kb = k.view(nb, block, h_kv, dim)
    lo = _round_to_fp16(kb.amin(1), down=True)
    hi = _round_to_fp16(kb.amax(1), down=False)
    qh = q.double().view(h_kv, groups, dim)
    terms = torch.maximum(torch.einsum("bkd,kgd->bkgd", lo, qh), torch.einsum("bkd,kgd->bkgd", hi, qh))
    # the products are exact in fp64 (fp16 × fp32); the sum of D terms errs by < D·2^-53·Σ|terms|
    bound = terms.sum(-1) + terms.abs().sum(-1) * 1e-13 + 1e-300
    block_bound = bound.reshape(nb, -1)
    tok = grid.token_bound.reshape(nb, block, -1).double()
    return Bounds(block_bound, torch.minimum(tok, block_bound[:, None]), block, index_bytes_per_unit=2 * dim * 2,
                  code_bytes_per_token=dim, extra_bytes_per_read_unit=3 * dim * 2, units_per_extra=page_size // block)


def _round_to_fp16(x: torch.Tensor, down: bool) -> torch.Tensor:
    """fp64 ``x`` to the nearest fp16 value on the safe side (below for ``down``), as fp64."""
    y = x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16).double()
    step = torch.nextafter(y.to(torch.float16), torch.full_like(y, -math.inf if down else math.inf,
                                                                dtype=torch.float16)).double()
    wrong = (y > x) if down else (y < x)
    return torch.where(wrong, step, y)


def calibrate(keys: torch.Tensor, rank: int) -> torch.Tensor:
    """P ``[H_kv, r, D]`` fp32: per KV head the top-``rank`` eigenvectors of Σ k kᵀ."""
    k = keys.double()
    second = torch.einsum("nhd,nhe->hde", k, k)
    _, vecs = torch.linalg.eigh(second)
    return vecs[..., -rank:].transpose(1, 2).float().contiguous()


def lowrank_bounds(keys, q, proj: torch.Tensor, idx, page_size: int = 64) -> Bounds:
    """The low-rank design (module docstring): an 8-bit grid over k̃ = fp32(Pk) and per token
    ‖k_R‖ and δ_k rounded up to fp16."""
    h_kv, dim = keys.shape[1], keys.shape[2]
    rank = proj.shape[1]
    groups = q.shape[0] // h_kv
    k64 = keys[: idx.stop * page_size].double()
    p64 = proj.double()
    kt = torch.einsum("hrd,nhd->nhr", proj, keys[: idx.stop * page_size].float())  # stored k̃ (fp32)
    pk = torch.einsum("hrd,nhd->nhr", p64, k64)
    k_res = k64 - torch.einsum("hrd,nhr->nhd", p64, pk)
    r_k = _round_to_fp16(k_res.norm(dim=-1) * (1 + 1e-12), down=False)
    delta = (torch.einsum("hrd,nhd->nhr", p64, k_res).norm(dim=-1) + (pk - kt.double()).norm(dim=-1)) * (1 + 1e-12)
    delta = _round_to_fp16(delta, down=False)
    low = grid_bounds(kt, _project_queries(q, proj), page_size, 8, idx)  # bounds of fp32(Pq)·k̃
    q64 = q.double().view(h_kv, groups, dim)
    pq = torch.einsum("hrd,hgd->hgr", p64, q64)
    q_res = (q64 - torch.einsum("hrd,hgr->hgd", p64, pq)).norm(dim=-1) * (1 + 1e-12)  # [H_kv, G]
    pq32 = _project_queries(q, proj).double().view(h_kv, groups, rank)
    q_err = (pq - pq32).norm(dim=-1) * (1 + 1e-12)  # the fp32 query's error against Pq
    kt_norm = kt.double().norm(dim=-1)  # [n, H_kv]
    n0, n1 = idx.start * page_size, idx.stop * page_size
    add = (r_k[n0:n1, :, None] * q_res[None] + delta[n0:n1, :, None] * pq.norm(dim=-1)[None]
           + kt_norm[n0:n1, :, None] * q_err[None])  # [n, H_kv, G]
    pages = idx.stop - idx.start
    add = add.reshape(pages, page_size, -1)
    tok = low.token_bound.double() + add
    page = low.unit_bound.double() + add.amax(1)
    return Bounds(page, torch.minimum(tok, page[:, None]), page_size, index_bytes_per_unit=3 * rank * 2 + 4,
                  code_bytes_per_token=rank + 4)


def _project_queries(q, proj):
    h_kv = proj.shape[0]
    groups = q.shape[0] // h_kv
    return torch.einsum("hrd,hgd->hgr", proj, q.float().view(h_kv, groups, -1)).reshape(q.shape[0], -1)


def step_bytes(b: Bounds, keep_unit, union, scores_idx, t, dense_tokens, n_tokens, sample, dim, groups):
    """Bytes of one query's step over all KV heads, and the dense bf16 K+V bytes. union
    ``[n_idx, H_kv]``; scores_idx ``[n_idx, H_q]``; t ``[H_q]`` (the value gate's T; None: every
    union row's V is read)."""
    h = keep_unit.shape[1]
    h_kv = h // groups
    row = 2 * dim  # one bf16 K or V row
    read_unit = keep_unit.view(-1, h_kv, groups).any(-1)  # [U, H_kv]
    units = keep_unit.shape[0]
    index = units * h_kv * b.index_bytes_per_unit + float(read_unit.sum()) * b.unit * b.code_bytes_per_token
    if b.extra_bytes_per_read_unit:
        pages = read_unit.view(-1, b.units_per_extra, h_kv).any(1)
        index += float(pages.sum()) * b.extra_bytes_per_read_unit
    k_rows = float(union.sum())
    v_rows = k_rows
    if t is not None:
        gate = th.gate_threshold(t).view(h_kv, groups)
        v_rows = float((union & (scores_idx.view(-1, h_kv, groups) >= gate).any(-1)).sum())
    moved = index + (k_rows + v_rows) * row + dense_tokens * h_kv * 2 * row + sample * h_kv * row
    return moved, n_tokens * h_kv * 2 * row


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
            coarse = getattr(bounds, "coarse", None)
            if coarse is not None:  # refined only at or above the window's lowest level
                t_lo = _window_floor(ref, z_lb, len(idx_pos), sigma, eps)
                token_bound = torch.where(coarse >= t_lo, bounds.token_bound, coarse)
            page_req = torch.zeros(bounds.unit_bound.shape[0], dtype=torch.long)
            t = th.certified_choice(bounds.unit_bound.float(), token_bound.float(), page_req, ref[None],
                                    z_lb[None], sigma, eps * th.BUDGET_SAFETY, th.HIST_ROUNDING)[0][0]
        keep_unit = ~(bounds.unit_bound < t)  # [U, H]
        keep_tok = keep_unit[:, None] & ~(bounds.token_bound < t)  # [U, unit, H]
        fine_read = None
        if getattr(bounds, "coarse", None) is not None:  # low nibbles read where the coarse bound reaches T
            fine_read = (keep_unit[:, None] & ~(bounds.coarse < t)).reshape(-1, keep_tok.shape[-1])
        keep = keep_tok.reshape(-1, keep_tok.shape[-1]).t()  # [H, n_idx]
        union = keep.view(h_kv, groups, -1).any(1)  # [H_kv, n_idx]
        reach = ~(s_idx < t.double()[:, None])
        recall_ok = bool((keep | ~reach).all())
        if eps is None:
            oracle = reach.view(h_kv, groups, -1).any(1)
        else:
            c = dict(m_idx=mass[:, idx_pos], z_true=z_true)
            oracle = oracle_keep(c, eps).t().reshape(h_kv, groups, -1).any(1)
        moved, dense_bytes = step_bytes(bounds, keep_unit, union.t(), s_idx.t().float(),
                                        t if eps is None else None, float(dense.sum()), n, len(sample), dim, groups)
        if fine_read is not None:
            moved += float(fine_read.view(-1, h_kv, groups).any(-1).sum()) * dim / 2
        out[policy] = dict(moved=moved, dense=dense_bytes, kept=int(union.sum()), oracle=int(oracle.sum()),
                           recall_ok=recall_ok)
    return out


def _window_floor(ref, z_lb, n_idx: int, sigma: float, eps: float, start: int = 4) -> torch.Tensor:
    """Per head the threshold at the safe level's edge plus ``start`` edges: the lowest level a
    one-pass certified step (``triton_tiled``) refines bounds at."""
    level = torch.log(eps * th.BUDGET_SAFETY * z_lb / max(n_idx, 1))
    edge = ((level - th.EDGE_LOW) / th.EDGE_STEP).floor().clamp(-1, th.EDGE_COUNT - 1).long() + start
    return th.edge_threshold(edge.clamp(min=0), ref, sigma)


def designs_for(keys, q, idx64, idx128, projections: dict) -> dict[str, tuple[Bounds, range, int]]:
    out = {}
    for bits in (8, 4):
        out[f"grid{bits}-p64"] = (grid_bounds(keys, q, 64, bits, idx64), idx64, 64)
        out[f"grid{bits}-p128"] = (grid_bounds(keys, q, 128, bits, idx128), idx128, 128)
    out["split4+4-p64"] = (split_bounds(keys, q, idx64, out["grid8-p64"][0]), idx64, 64)
    for block in (8, 16, 32):
        out[f"tier{block}-grid8-p64"] = (tier_bounds(keys, q, block, idx64, out["grid8-p64"][0]), idx64, 64)
    for rank, proj in projections.items():
        out[f"lowrank{rank}-p64"] = (lowrank_bounds(keys, q, proj, idx64), idx64, 64)
    return out


def measure_trace(path: Path, calibration: Path, ranks, stride: int) -> dict:
    trace, calib = load_trace(path), load_trace(calibration)
    sigma = float(trace["meta"]["softmax_scale"])
    totals: dict[tuple[str, str], dict] = {}
    for layer in sorted(trace["keys"]):
        keys, queries = trace["keys"][layer], trace["queries"][layer]
        projections = {r: calibrate(calib["keys"][layer], r) for r in ranks}
        for qi, pos in list(enumerate(trace["query_positions"].tolist()))[::stride]:
            k = keys[: pos + 1]
            idx64 = split_pages(pos + 1, LouverConfig(page_size=64))[1]
            idx128 = split_pages(pos + 1, LouverConfig(page_size=128))[1]
            for design, (bounds, idx, page) in designs_for(k, queries[qi], idx64, idx128, projections).items():
                for policy, r in measure_query(k, queries[qi], sigma, design, bounds, idx, page, 256).items():
                    acc = totals.setdefault((design, policy), dict(moved=0.0, dense=0.0, kept=0, oracle=0, recall=True))
                    acc["moved"] += r["moved"]
                    acc["dense"] += r["dense"]
                    acc["kept"] += r["kept"]
                    acc["oracle"] += r["oracle"]
                    acc["recall"] &= r["recall_ok"]
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", nargs="+", required=True)
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--query-stride", type=int, default=4, help="every n-th captured query")
    parser.add_argument("--out", default="benchmarks/results/index_bytes.json")
    args = parser.parse_args()
    rows, start = [], time.time()
    for path in map(Path, args.traces):
        other = [Path(t) for t in args.traces if Path(t).name.split("_")[0] != path.name.split("_")[0]]
        calibration = other[0] if other else path  # the projection comes from another text
        for (design, policy), acc in measure_trace(path, calibration, args.ranks, args.query_stride).items():
            rows.append(dict(design=design, trace=path.stem, policy=policy, bytes_fraction=acc["moved"] / acc["dense"],
                             recall=1.0 if acc["recall"] else 0.0, kept_over_oracle=acc["kept"] / max(acc["oracle"], 1),
                             shipped=design in SHIPPED, shipped_on=SHIPPED.get(design, []),
                             calibrated_on=calibration.stem if design.startswith("lowrank") else None))
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
