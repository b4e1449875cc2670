"""What the dense fallback costs the compiled CPU step, on captured traces.

The compiled step decides the fallback from its own union count, after its sparse pass; a request
over the fraction then gets the dense policy's step as well. This times, in alternation (paired
medians), per trace and layer at batch 1: the dense policy's step, the certified step with the
fallback off (fraction 1.0), and the same step with every request forced over the fraction
(fraction 1e-6), so that the last one is the price of every fallback the server takes.

    python -m benchmarks.cpu.fallback_cost_cpu --traces data/traces/bible_8192.pt data/traces/bible_32768.pt
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import torch

from louver_kernels.cpu_ops import cpu_model_name
from louver_sgl import LouverConfig, PageIndexStore
from louver_eval.data.paged import load_trace, paged_batch
from louver_sgl.decode import LouverDecode
from benchmarks.record import command_line

CASES = {
    "dense": dict(policy="dense"),
    "sparse": dict(dense_fallback_fraction=1.0),
    "fallback": dict(dense_fallback_fraction=1e-6),
}


def _prepared(batch, config: LouverConfig):
    store = PageIndexStore(config, len(batch.k) // config.page_size, batch.k.shape[1], batch.k.shape[2],
                           batch.k.dtype)
    store.build_pages(batch.k, torch.arange(store.num_pages))
    decode = LouverDecode(config, "cpu", impl="cpu")
    decode.plan(batch.page_table, batch.seq_lens)
    stats = decode.run(batch.q, batch.k, batch.v, store, batch.sigma, stats=True).stats
    return decode, store, bool(stats.dense_fallback.all())


def measure(path: str, layer: int, eps: float, repeats: int) -> dict:
    batch = paged_batch(load_trace(path), layer, 1, LouverConfig.page_size, dtype=torch.float16)
    steps = {name: _prepared(batch, LouverConfig(policy="certified", eps=eps).with_(**kw))
             for name, kw in CASES.items()}
    times = {name: [] for name in CASES}
    for _ in range(repeats):  # interleaved: drift of a noisy machine hits every case alike
        for name, (decode, store, _) in steps.items():
            start = time.perf_counter()
            decode.run(batch.q, batch.k, batch.v, store, batch.sigma)
            times[name].append((time.perf_counter() - start) * 1e3)
    ms = {name: statistics.median(t) for name, t in times.items()}
    return dict(trace=Path(path).name, layer=layer, eps=eps, tokens=int(batch.seq_lens[0]),
                ms=ms, fell_back={name: s[2] for name, s in steps.items()},
                fallback_over_sparse=ms["fallback"] / ms["sparse"], fallback_over_dense=ms["fallback"] / ms["dense"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", nargs="+", default=["data/traces/bible_8192.pt", "data/traces/bible_32768.pt"])
    parser.add_argument("--layers", type=int, nargs="+", default=[9, 21])
    parser.add_argument("--eps", type=float, default=1e-3)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="benchmarks/results/fallback_cost_cpu.json")
    args = parser.parse_args()
    rows = []
    for path in args.traces:
        for layer in args.layers:
            rows.append(measure(path, layer, args.eps, args.repeats))
            r = rows[-1]
            print(f"{r['trace']} layer {layer}: dense {r['ms']['dense']:.3f} ms, sparse {r['ms']['sparse']:.3f} ms, "
                  f"with fallback {r['ms']['fallback']:.3f} ms ({r['fallback_over_sparse']:.2f}x sparse, "
                  f"{r['fallback_over_dense']:.2f}x dense)", flush=True)
    result = dict(command=command_line(),
                  date=date.today().isoformat(), cpu=cpu_model_name(), machine=platform.machine(),
                  threads=torch.get_num_threads(), rows=rows)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
