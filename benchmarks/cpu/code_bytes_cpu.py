"""Does the compiled CPU step wait on its code bytes? 8-bit against 4-bit codes, few candidates.

A budget step at a tiny budget opens every page and reads every code but gathers few candidate
rows, so its time is the exact part, the per-page work (page terms, int8 weights) and the code
scan. 4-bit codes are half the bytes of 8-bit ones with the same per-page work and the same
integer dots per token: if the scan waited on memory, the 4-bit step would be faster by the time
those bytes take. Bit-plane indexes (docs/results.md, "Bytes moved per step") save code bytes,
so this says what they could buy this CPU. Steps timed in shuffled order with a 64 MiB sweep
before each (cold caches, as in a server that runs the other layers in between); medians.

    python -m benchmarks.cpu.code_bytes_cpu --trace data/traces/bible_32768.pt \\
        --out benchmarks/results/code_bytes_cpu.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from louver_kernels.cpu_ops import cpu_model_name
from louver_sgl import LouverConfig, PageIndexStore
from louver_eval.data.paged import load_trace, paged_batch
from louver_sgl.decode import LouverDecode
from benchmarks.record import write_result

SWEEP_BYTES = 64 << 20


def make_step(pb, bits: int, page: int, budget: float):
    """The compiled budget step over ``pb`` with ``bits``-bit codes and pages of ``page`` tokens,
    and its union-candidate share (rows over indexed rows)."""
    cfg = LouverConfig(grid_bits=bits, page_size=page, policy="budget", budget=budget)
    store = PageIndexStore(cfg, len(pb.k) // page, pb.k.shape[1], pb.k.shape[2], pb.k.dtype)
    decode = LouverDecode(cfg, "cpu", impl="cpu").plan(pb.page_table, pb.seq_lens)
    store.build_pages(pb.k, decode.current_plan.page_ids)
    step = lambda: decode.run(pb.q, pb.k, pb.v, store, pb.sigma, stats=True)  # noqa: E731
    stats = step().stats
    union = float(stats.union_candidates.sum() / (stats.num_indexed.sum() * pb.k.shape[1]))
    code_bytes = int(stats.num_indexed.sum()) * pb.k.shape[1] * pb.k.shape[2] * bits // 8
    return step, union, code_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="data/traces/bible_32768.pt")
    parser.add_argument("--layers", type=int, nargs="+", default=[9, 15, 21])
    parser.add_argument("--pages", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--budget", type=float, default=0.001)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default="benchmarks/results/code_bytes_cpu.json")
    args = parser.parse_args()
    trace = load_trace(args.trace)
    steps, rows = {}, []
    for layer in args.layers:
        for page in args.pages:
            pb = paged_batch(trace, layer, 1, page)
            for bits in (8, 4):
                step, union, code_bytes = make_step(pb, bits, page, args.budget)
                steps[(layer, page, bits)] = step
                rows.append(dict(layer=layer, page_size=page, bits=bits, union_candidates=union, code_bytes=code_bytes))
    sweep = torch.ones(SWEEP_BYTES // 4)
    times = {key: [] for key in steps}
    for _ in range(args.rounds):
        order = list(steps)
        random.shuffle(order)
        for key in order:
            sweep.mul_(1.0)
            start = time.perf_counter()
            steps[key]()
            times[key].append(time.perf_counter() - start)
    for row in rows:
        row["ms"] = 1e3 * statistics.median(times[(row["layer"], row["page_size"], row["bits"])])
    for row in rows:
        if row["bits"] == 4:
            eight = next(r for r in rows if r["bits"] == 8 and r["layer"] == row["layer"]
                         and r["page_size"] == row["page_size"])
            row["ms_over_8bit"] = row["ms"] / eight["ms"]
        print(f"layer {row['layer']:>2} page {row['page_size']:>3} {row['bits']}-bit: {row['ms']:.3f} ms, "
              f"union {100 * row['union_candidates']:.1f} %, codes {row['code_bytes'] / 2**20:.1f} MiB"
              + (f", {row['ms_over_8bit']:.2f}x the 8-bit step" if row["bits"] == 4 else ""))
    write_result(args.out, {"machine": cpu_model_name(), "threads": torch.get_num_threads(), "trace": args.trace,
                            "budget": args.budget, "rows": rows})


if __name__ == "__main__":
    main()
