"""Which index settings prune best per byte? Candidate fraction vs index bytes per token.

For every captured layer and query, T is set so that a fraction f of the indexed keys truly pass
(exact fp64 quantile); the table reports the candidate fraction each setting returns (zero false
negatives is asserted on every query) and the index bytes per token and KV head.

    python -m benchmarks.studies.bound_families --trace data/traces/bible_8192.pt --out benchmarks/results/bound_families.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm

from louver_eval.data.paged import load_trace
from louver_sgl import LouverConfig, LouverIndex
from benchmarks.record import write_result

SETTINGS = {
    "grid-2bit": LouverConfig(family="grid", grid_bits=2),
    "grid-4bit": LouverConfig(family="grid", grid_bits=4),
    "grid-8bit": LouverConfig(family="grid", grid_bits=8),
    "clustered-S8-bf4": LouverConfig(family="clustered", n_subspaces=8, cluster_size=4),
    "clustered-S16-bf4": LouverConfig(family="clustered", n_subspaces=16, cluster_size=4),
    "clustered-S16-bf4-residual": LouverConfig(family="clustered", n_subspaces=16, cluster_size=4, residual_norms=True),
    "clustered-S32-bf2": LouverConfig(family="clustered", n_subspaces=32, cluster_size=2),
}
FRACTIONS = (0.01, 0.05, 0.1)


def measure(trace: dict, layers: list[int], settings: dict[str, LouverConfig]) -> list[dict]:
    rows = []
    for layer in tqdm(layers, desc="layers"):
        keys, queries = trace["keys"][layer], trace["queries"][layer]
        n = int(trace["query_positions"][0]) + 1
        k = keys[:n]
        groups = queries.shape[1] // k.shape[1]
        scores = torch.einsum("qhd,nhd->qhn", queries.double(), k.double().repeat_interleave(groups, 1))
        for name, cfg in settings.items():
            start = time.perf_counter()
            index = LouverIndex.build(k, cfg)
            build_s = time.perf_counter() - start
            n_idx = index.num_indexed
            for f in FRACTIONS:
                fracs = []
                for qi in range(len(queries)):
                    t = scores[qi, :, :n_idx].quantile(1 - f, dim=1).float()
                    mask = index.range_search(queries[qi], t)[:, :n_idx]
                    exact = scores[qi, :, :n_idx] >= t.double()[:, None]
                    assert not bool((exact & ~mask).any()), f"false negative: {name} layer {layer}"
                    fracs.append(mask.float().mean().item())
                rows.append({
                    "layer": layer, "setting": name, "f": f,
                    "candidate_fraction": sum(fracs) / len(fracs),
                    "bytes_per_token_head": index.store.bytes_per_token_head(),
                    "build_us_per_token": 1e6 * build_s / n_idx,
                })
    return rows


def summarize(rows: list[dict], head_dim: int) -> list[dict]:
    """Average over layers, plus the design's cost model: bytes read per token and KV head relative
    to dense fp16 K+V (4·D): index bytes + candidate keys (2·D each) + surviving values (2·D each)."""
    out = []
    for name in dict.fromkeys(r["setting"] for r in rows):
        entry = {"setting": name}
        for f in FRACTIONS:
            sel = [r for r in rows if r["setting"] == name and r["f"] == f]
            entry[f"cand@{f}"] = sum(r["candidate_fraction"] for r in sel) / len(sel)
        sel = [r for r in rows if r["setting"] == name]
        for f in FRACTIONS:
            read = sel[0]["bytes_per_token_head"] + (entry[f"cand@{f}"] + f) * 2 * head_dim
            entry[f"read_vs_dense@{f}"] = read / (4 * head_dim)
        entry["bytes_per_token_head"] = sel[0]["bytes_per_token_head"]
        entry["build_us_per_token"] = sum(r["build_us_per_token"] for r in sel) / len(sel)
        out.append(entry)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="data/traces/bible_8192.pt")
    parser.add_argument("--layers", type=int, nargs="*", default=None)
    parser.add_argument("--out", default="benchmarks/results/bound_families.json")
    args = parser.parse_args()
    trace = load_trace(args.trace)
    layers = args.layers or list(trace["keys"])
    rows = measure(trace, layers, SETTINGS)
    summary = summarize(rows, int(trace["meta"]["head_dim"]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, {"trace": args.trace, "summary": summary, "rows": rows})
    head = " ".join(f"{'cand f=' + str(f):>11s}" for f in FRACTIONS)
    head += " " + " ".join(f"{'read f=' + str(f):>11s}" for f in FRACTIONS)
    print(f"{'setting':28s} {'B/tok/head':>10s} {head}")
    for s in summary:
        cells = [s[f"cand@{f}"] for f in FRACTIONS] + [s[f"read_vs_dense@{f}"] for f in FRACTIONS]
        print(f"{s['setting']:28s} {s['bytes_per_token_head']:10.1f} " + " ".join(f"{c:11.3f}" for c in cells))


if __name__ == "__main__":
    main()
