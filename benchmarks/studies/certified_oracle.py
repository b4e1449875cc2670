"""Certified keys kept against an exact oracle at the same ε, on captured traces.

Per decode query of a trace (every captured query of every captured layer) and per KV head, the
kept fraction is the GQA union of the group's indexed keys attended, over the indexed keys.
Rules compared (all with the step's own fp32 bounds, ``PageIndexStore`` of ``--grid-bits`` and
``--page-size``, and the reference step's exact part: sink/recent pages, tail, sample):

* ``histogram``: the shipped rule (``threshold.certified_choice``: the largest edge whose bound
  fits eps·Z_lb, Z_lb over the exact part only);
* ``a_posteriori-<share>``: the a-posteriori rule (``threshold.estimated_z``,
  ``a_posteriori_first``, ``a_posteriori_second``): the first level from the sample-scaled
  estimate of Z times ``share``, checked against Z_att, the exact mass of everything the first
  pass attends; where the check fails, the second level from Z_att (the band pass);
* ``exact_z``: the largest edge whose bound fits eps·Z with the true Z (not a certificate: the
  floor any rule on these bounds reaches; the rest of the gap to the oracle is the bounds' slack);
* ``oracle``: per query head, the fewest indexed keys (highest exact scores first) whose
  complement's true mass is ≤ eps·Z; per KV head, the union of its group's sets.

With ``--int8`` the token bounds are the compiled kernels' int8 ones (what ``cpu`` and ``triton``
gate and certify with); with ``--residual`` too, the compiled CPU step's with residual int8 weights
(``CpuLaunch.residual_weights``). It checks on every case that recall of {s ≥ T} is 1 and that the true
dropped mass is ≤ ε for the certified rules, and reports how often the band pass runs (query
heads, and requests with any).

    python -m benchmarks.studies.certified_oracle --traces data/traces/bible_8192.pt data/traces/bible_32768.pt \\
        --eps 1e-2 1e-3 1e-4 --out benchmarks/results/certified_oracle.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

from louver_sgl import LouverConfig, PageIndexStore
from louver_eval.data.paged import load_trace
from louver_sgl.decode import threshold as th
from louver_sgl.decode.reference_compiled import int8_token_bounds_reference
from louver_sgl.decode.plan import _sample_positions, split_pages
from benchmarks.record import stamped

SHARES = (4.0, 3.0, 2.0, 1.0, 0.5)


def case_inputs(keys, q, store: PageIndexStore, config: LouverConfig, sigma: float, int8: bool = False,
                residual: bool = False) -> dict:
    """One query ``[H_q, D]`` over ``keys`` ``[n, H_kv, D]``: bounds (with ``int8`` the compiled
    kernels' int8 token bounds, ``reference_compiled.int8_token_bounds_reference``, with residual
    weights where ``residual``), exact part, exact scores."""
    n, h_kv, _ = keys.shape
    size, groups = config.page_size, q.shape[0] // h_kv
    _, indexed, _ = split_pages(n, config)
    scores = torch.einsum("hd,lhd->hl", q.float(), keys.float().repeat_interleave(groups, 1))
    idx_pos = torch.arange(indexed.start * size, indexed.stop * size)
    dense = torch.ones(n, dtype=torch.bool)
    dense[idx_pos] = False
    sample = idx_pos[_sample_positions(len(idx_pos), config.sample_size)]
    known = dense.clone()
    known[sample] = True
    ref = torch.where(known, scores, -math.inf).amax(1)
    mass = torch.exp(th.log_mass(scores, ref[:, None], sigma).clamp(max=700.0))  # [H, n] fp64
    page_ids = torch.arange(indexed.start, indexed.stop)
    rows = q.float().view(1, h_kv, groups, -1).expand(len(page_ids), -1, -1, -1).contiguous()
    bounds = store.page_bounds(rows, page_ids)
    if int8:
        tok = int8_token_bounds_reference(*bounds.terms, store.page_codes(page_ids), config.grid_bits, residual)
    else:
        tok = store.token_bounds(bounds, page_ids)
    pb = bounds.page_bound.reshape(len(page_ids), -1)
    tb = tok.reshape(len(page_ids), size, -1)
    z_dense = (mass * dense).sum(1)
    return dict(pb=pb, tb=torch.minimum(tb, pb[:, None, :]), ref=ref, s_idx=scores[:, idx_pos],
                m_idx=mass[:, idx_pos], z_dense=z_dense, z_sample=mass[:, sample].sum(1),
                z_true=z_dense + mass[:, idx_pos].sum(1), n_idx=len(idx_pos), n_sample=len(sample),
                groups=groups)


def kept_at(c: dict, t: torch.Tensor) -> torch.Tensor:
    """Per query head, the indexed keys whose bound reaches T_h: bool ``[n_idx, H]``."""
    u = c["tb"].reshape(-1, c["tb"].shape[-1])
    return ~(u < t)


def union(keep: torch.Tensor, groups: int) -> torch.Tensor:
    """``[n_idx, H]`` -> the GQA union per KV head, repeated to its query heads ``[n_idx, H]``."""
    n, h = keep.shape
    return keep.view(n, h // groups, groups).any(-1).repeat_interleave(groups, dim=1)


def oracle_keep(c: dict, eps: float) -> torch.Tensor:
    """Per query head the fewest highest-scoring indexed keys whose complement's mass ≤ eps·Z."""
    m = c["m_idx"].t()  # [n, H]
    order = m.argsort(dim=0, descending=True)
    sorted_m = m.gather(0, order)
    rest = sorted_m.sum(0, keepdim=True) - sorted_m.cumsum(0)  # mass left after the first i+1 keys
    need = (rest > eps * c["z_true"][None]).sum(0) + 1  # keys to keep so that the rest fits
    need = torch.where(c["m_idx"].sum(1) <= eps * c["z_true"], 0, need)
    rank = torch.empty_like(order)
    rank.scatter_(0, order, torch.arange(len(m))[:, None].expand_as(order))
    return rank < need[None]


def a_posteriori(c: dict, bound, eps_budget: float, sigma: float, share: float):
    """(T ``[H]``, band ``[H]`` bool) of the a-posteriori rule on one case."""
    ref, one = c["ref"][None], torch.ones(1, dtype=torch.long)
    z_est = th.estimated_z(c["z_dense"][None], c["z_sample"][None], one * c["n_idx"], one * c["n_sample"], share)
    edge0, t0 = th.a_posteriori_first(bound, ref, z_est, sigma, eps_budget)
    att = union(kept_at(c, t0[0]), c["groups"])
    z_att = torch.maximum(c["z_dense"] + c["z_sample"], c["z_dense"] + (c["m_idx"].t() * att).sum(0))
    _, t, _, band = th.a_posteriori_second(bound, edge0, ref, z_att[None], sigma, eps_budget)
    return t[0], band[0]


def measure_case(c: dict, eps: float, sigma: float) -> dict:
    eps_budget = eps * th.BUDGET_SAFETY
    page_req = torch.zeros(c["pb"].shape[0], dtype=torch.long)
    z_lb = (c["z_dense"] + c["z_sample"])[None]
    t_hist, _, hist, habs = th.certified_choice(c["pb"], c["tb"], page_req, c["ref"][None], z_lb, sigma,
                                                eps_budget, th.HIST_ROUNDING)
    bound = th.histogram_bound(hist, habs, th.HIST_ROUNDING)
    levels = {"histogram": (t_hist[0], None)}
    for share in SHARES:
        levels[f"a_posteriori-{share:g}"] = a_posteriori(c, bound, eps_budget, sigma, share)
    exact_edge = th.pick_edge(bound, eps_budget * c["z_true"][None])
    levels["exact_z"] = (th.edge_threshold(exact_edge, c["ref"][None], sigma)[0], None)
    g = c["groups"]
    row = {}
    for rule, (t, band) in levels.items():
        keep = union(kept_at(c, t), g)
        reached = ~(c["s_idx"].t() < t)  # exact score ≥ T
        dropped = (c["m_idx"].t() * ~keep).sum(0) / c["z_true"]
        row[rule] = dict(kept=int(keep[:, ::g].sum()), recall_ok=bool((keep | ~reached).all()),
                         max_dropped=float(dropped.max()), band_heads=0 if band is None else int(band.sum()))
    keep = union(oracle_keep(c, eps), g)
    row["oracle"] = dict(kept=int(keep[:, ::g].sum()), recall_ok=True,
                         max_dropped=float(((c["m_idx"].t() * ~keep).sum(0) / c["z_true"]).max()), band_heads=0)
    return row


def measure(path: Path, eps_list, config: LouverConfig, int8: bool = False, residual: bool = False) -> list[dict]:
    trace = load_trace(path)
    sigma = float(trace["meta"]["softmax_scale"])
    rows = []
    for layer in sorted(trace["keys"]):
        keys, queries = trace["keys"][layer], trace["queries"][layer]
        h_kv = keys.shape[1]
        for qi, pos in enumerate(trace["query_positions"].tolist()):
            k = keys[: pos + 1]
            store = PageIndexStore(config, (pos + 1) // config.page_size + 1, h_kv, k.shape[2], k.dtype)
            full = (pos + 1) // config.page_size
            store.build_pages(k[: full * config.page_size], torch.arange(full))
            c = case_inputs(k, queries[qi], store, config, sigma, int8, residual)
            for eps in eps_list:
                rows.append(dict(trace=path.name, layer=layer, query=qi, eps=eps, indexed=c["n_idx"] * h_kv,
                                 heads=queries.shape[1], rules=measure_case(c, eps, sigma)))
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["trace"], r["eps"]), []).append(r)
    table = []
    for (trace, eps), rs in groups.items():
        indexed = sum(r["indexed"] for r in rs)
        oracle = sum(r["rules"]["oracle"]["kept"] for r in rs)
        for rule in rs[0]["rules"]:
            kept = sum(r["rules"][rule]["kept"] for r in rs)
            band = sum(r["rules"][rule]["band_heads"] for r in rs)
            table.append(dict(
                trace=trace, eps=eps, rule=rule, cases=len(rs), kept_fraction=kept / indexed,
                vs_oracle=kept / max(oracle, 1), recall_ok=all(r["rules"][rule]["recall_ok"] for r in rs),
                max_dropped_mass=max(r["rules"][rule]["max_dropped"] for r in rs),
                band_head_share=band / sum(r["heads"] for r in rs),
                band_step_share=sum(r["rules"][rule]["band_heads"] > 0 for r in rs) / len(rs)))
    return table


def markdown(table: list[dict], rules: list[str]) -> str:
    """The docs table: one row per (trace, eps), kept fraction (× the oracle's) per rule, and how
    often the band pass ran (query heads, steps) for the a-posteriori rules."""
    cells: dict[tuple, dict] = {}
    for row in table:
        cells.setdefault((row["trace"], row["eps"]), {})[row["rule"]] = row
    head = "| trace | ε | " + " | ".join(rules) + " |"
    lines = [head, "|" + "---|" * (len(rules) + 2)]
    for (trace, eps), by_rule in cells.items():
        out = []
        for rule in rules:
            r = by_rule[rule]
            text = f"{100 * r['kept_fraction']:.1f} % ({r['vs_oracle']:.2f}x)"
            if rule.startswith("a_posteriori"):
                text += f", band {100 * r['band_head_share']:.0f} % / {100 * r['band_step_share']:.0f} %"
            out.append(text)
        lines.append(f"| {trace} | {eps:g} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def _result_key(args: argparse.Namespace) -> str:
    """The entry of the result file one index configuration writes and ``--markdown`` reads."""
    return f"grid{args.grid_bits}-p{args.page_size}" + ("-int8" if args.int8 else "") + ("-residual" if args.residual else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", nargs="+", required=True)
    parser.add_argument("--eps", type=float, nargs="+", default=[1e-2, 1e-3, 1e-4])
    parser.add_argument("--grid-bits", type=int, default=LouverConfig.grid_bits)
    parser.add_argument("--page-size", type=int, default=LouverConfig.page_size)
    parser.add_argument("--out", default="benchmarks/results/certified_oracle.json")
    parser.add_argument("--int8", action="store_true",
                        help="gate and certify with the compiled kernels' int8 token bounds (cpu, triton)")
    parser.add_argument("--residual", action="store_true",
                        help="with --int8: the compiled CPU step's bounds with residual int8 weights")
    parser.add_argument("--markdown", nargs="*", metavar="RULE",
                        help="print the docs table of --out for these rules (default: histogram, "
                             "a_posteriori at the default share, exact_z, oracle) and exit")
    args = parser.parse_args()
    if args.residual and not args.int8:
        parser.error("--residual needs --int8 (it is a form of the compiled kernels' int8 bounds)")
    if args.markdown is not None:
        share = f"a_posteriori-{LouverConfig.estimate_share:g}"
        rules = args.markdown or ["histogram", share, "exact_z", "oracle"]
        print(markdown(json.loads(Path(args.out).read_text())[_result_key(args)]["summary"], rules))
        return
    config = LouverConfig(page_size=args.page_size, grid_bits=args.grid_bits, policy="certified")
    start = time.time()
    rows = []
    for path in args.traces:
        rows += measure(Path(path), args.eps, config, args.int8, args.residual)
        print(f"[certified_oracle] {path}: done ({time.time() - start:.0f} s)", file=sys.stderr)
    table = summarize(rows)
    for row in table:
        print(f"{row['trace']:>22} eps={row['eps']:<6g} {row['rule']:>18}: kept {row['kept_fraction']:.3f} "
              f"({row['vs_oracle']:.2f}x oracle) recall_ok={row['recall_ok']} max_dropped={row['max_dropped_mass']:.2e} "
              f"band heads {row['band_head_share']:.2f} steps {row['band_step_share']:.2f}")
    out = Path(args.out)
    previous = json.loads(out.read_text()) if out.exists() else {}
    previous[_result_key(args)] = {**stamped({}),
                                   "machine": platform.processor() or platform.machine(), "config": vars(args),
                                   "summary": table}
    out.write_text(json.dumps(previous, indent=1))


if __name__ == "__main__":
    main()
