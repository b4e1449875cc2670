"""Where the certified histogram rule's level lies above the safe level, on captured traces: the
window ``triton_tiled`` evaluates in one pass over the codes must hold it.

Per captured decode query of every captured layer and per query head: the histogram rule's
edge e* (``threshold.certified_choice`` with the kernels' int8 token bounds) and the safe level's
edge e_safe (the highest edge at which n indexed tokens, each just below it, fit ε·Z_lb; the rule
is never below it). Reports the distribution of e* − e_safe and the share of heads a window of K
edges starting ``start`` edges above e_safe holds (K = the launch parameter ``window_edges``,
start = ``window_start``).

    python -m benchmarks.studies.certified_window --traces data/traces/bible_8192.pt \\
        data/traces/bible_32768.pt data/traces/paul_graham_8192.pt data/traces/paul_graham_32768.pt \\
        --out benchmarks/results/certified_window.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.record import stamped
from benchmarks.studies.certified_oracle import case_inputs
from louver_eval.data.paged import load_trace
from louver_sgl import LouverConfig, PageIndexStore
from louver_sgl.decode import threshold as th

WINDOWS = ((4, 16), (4, 32), (4, 64))


def distances(path: Path, config: LouverConfig, eps_list) -> dict[float, list[int]]:
    """e* − e_safe per (query, head) of one trace, per eps."""
    trace = load_trace(path)
    sigma = float(trace["meta"]["softmax_scale"])
    out: dict[float, list[int]] = {eps: [] for eps in eps_list}
    for layer in sorted(trace["keys"]):
        keys, queries = trace["keys"][layer], trace["queries"][layer]
        h_kv = keys.shape[1]
        for qi, pos in enumerate(trace["query_positions"].tolist()):
            k = keys[: pos + 1]
            full = (pos + 1) // config.page_size
            store = PageIndexStore(config, full + 1, h_kv, k.shape[2], k.dtype)
            store.build_pages(k[: full * config.page_size], torch.arange(full))
            c = case_inputs(k, queries[qi], store, config, sigma, int8=True)
            page_req = torch.zeros(c["pb"].shape[0], dtype=torch.long)
            z_lb = (c["z_dense"] + c["z_sample"])[None]
            for eps in eps_list:
                budget = eps * th.BUDGET_SAFETY
                _, _, hist, habs = th.certified_choice(c["pb"], c["tb"], page_req, c["ref"][None], z_lb, sigma,
                                                       budget, th.HIST_ROUNDING)
                e_star = th.pick_edge(th.histogram_bound(hist, habs, th.HIST_ROUNDING), budget * z_lb)[0]
                safe = c["n_idx"] * torch.exp(th.EDGE_VALUES)[None] <= budget * z_lb[0][:, None]
                e_safe = torch.where(safe, torch.arange(th.EDGE_COUNT), -1).amax(-1)
                out[eps] += (e_star - e_safe).tolist()
    return out


def summary(trace: str, eps: float, d: list[int]) -> dict:
    t = torch.tensor(d, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.0, 0.5, 0.9, 0.99, 1.0], dtype=torch.float64)).tolist()
    held = {f"start{s}_edges{k}": float(((t >= s) & (t < s + k)).double().mean()) for s, k in WINDOWS}
    return dict(trace=trace, eps=eps, heads=len(d), min=q[0], median=q[1], p90=q[2], p99=q[3], max=q[4],
                below_start=float((t < WINDOWS[0][0]).double().mean()), window_holds=held)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", nargs="+", required=True)
    parser.add_argument("--eps", type=float, nargs="+", default=[1e-2, 1e-3])
    parser.add_argument("--grid-bits", type=int, default=8)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/certified_window.json")
    args = parser.parse_args()
    config = LouverConfig(page_size=args.page_size, grid_bits=args.grid_bits, policy="certified")
    rows = []
    for path in args.traces:
        for eps, d in distances(Path(path), config, args.eps).items():
            rows.append(summary(Path(path).name, eps, d))
            print(json.dumps(rows[-1]))
    Path(args.out).write_text(json.dumps(stamped({"config": vars(args), "rows": rows}), indent=1))


if __name__ == "__main__":
    main()
