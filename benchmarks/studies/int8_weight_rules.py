"""The compiled CPU bounds' int8 weight rules on real traces: how coarse each rule's step is and how
many keys its token bounds pass (torch specification, ``int8_token_bounds_reference``).

Rules: ``±127`` per weight (AVX-512 VNNI builds, the Triton kernels), ``±63`` per weight (the AVX2
8-bit scan's rule before lane groups), ``lane groups`` (the AVX2 8-bit scan's rule: Σ|wq| <= 128
over each int16 lane group; design notes, "Instruction sets"). Per trace and layer: the median
over (query, page, head) of each rule's step over ±63's, and the GQA union (keys some head of the
group keeps, by its token and page bound) at the 95th-percentile exact score of each head, with
recall against fp64 checked for every rule.

    python -m benchmarks.studies.int8_weight_rules --traces data/traces/bible_32768.pt \\
        data/traces/paul_graham_32768.pt --out benchmarks/results/int8_weight_rules.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from louver_eval.data.capture import load_trace
from louver_sgl import LouverConfig, PageIndexStore
from louver_sgl.decode.reference_compiled import Int8Rule, int8_token_bounds_reference

RULES = {"±127": Int8Rule(127, 0.0), "±63": Int8Rule(63, 0.0), "lane groups": Int8Rule(127, 125.0)}


def layer_rows(keys: torch.Tensor, queries: torch.Tensor, page: int, quantile: float) -> dict:
    """Step ratios and GQA unions of every rule for one layer: keys ``[N, H_kv, D]``, queries
    ``[Q, H_q, D]`` (fp32)."""
    n = keys.shape[0] // page * page
    keys = keys[:n]
    h_kv, dim = keys.shape[1], keys.shape[2]
    groups = queries.shape[1] // h_kv
    store = PageIndexStore(LouverConfig(page_size=page, grid_bits=8), n // page, h_kv, dim, keys.dtype)
    pages = torch.arange(n // page)
    store.build_pages(keys, pages)
    codes = store.page_codes(pages)
    ratios = {name: [] for name in RULES}
    unions = {name: [] for name in RULES}
    for q in queries:
        rows = q.view(1, h_kv, groups, dim).expand(len(pages), -1, -1, -1).contiguous()
        bounds = store.page_bounds(rows, pages)
        weights = bounds.terms[0]
        pm63 = RULES["±63"].step(weights)
        exact = torch.einsum("nkd,kgd->nkg", keys.double(), q.view(h_kv, groups, dim).double())
        t = torch.quantile(exact.reshape(n, -1).float(), quantile, dim=0).view(1, h_kv, groups)
        page_bound = bounds.page_bound.repeat_interleave(page, 0)
        for name, rule in RULES.items():
            ratios[name].append((rule.step(weights) / pm63).flatten())
            tok = int8_token_bounds_reference(*bounds.terms, codes, 8, False, rule).reshape(n, h_kv, groups)
            keep = ~(tok < t) & ~(page_bound < t)
            if bool((~keep & (exact >= t.double())).any()):
                raise AssertionError(f"rule {name}: a key at or above T is not kept")
            unions[name].append(float(keep.any(-1).float().mean()))
    return {name: {"step_over_pm63_median": float(torch.cat(ratios[name]).median()),
                   "gqa_union": sum(unions[name]) / len(unions[name])} for name in RULES}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", nargs="+", required=True)
    parser.add_argument("--layers", nargs="+", type=int, default=[3, 9, 15, 21, 27])
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--quantile", type=float, default=0.95, help="T per head: this quantile of its exact scores")
    parser.add_argument("--query-stride", type=int, default=1, help="every n-th captured query")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    rows = []
    for path in args.traces:
        trace = load_trace(path)
        for layer in args.layers:
            keys = trace["keys"][layer].float()
            queries = trace["queries"][layer].float()[:: args.query_stride]
            result = layer_rows(keys, queries, args.page_size, args.quantile)
            rows.append({"trace": Path(path).name, "layer": layer, "rules": result})
            print(Path(path).name, layer, "  ".join(f"{name}: step {r['step_over_pm63_median']:.3f} of ±63, "
                                                    f"union {100 * r['gqa_union']:.1f} %"
                                                    for name, r in result.items()), flush=True)
    args.out.write_text(json.dumps({"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
                                    "page_size": args.page_size, "quantile": args.quantile, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
