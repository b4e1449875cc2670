"""Same-process A/B of two builds of the compiled CPU step on a captured trace.

The baseline build (``--baseline-src``: the kernels/cpu folder of another source tree, e.g. a
``git worktree`` of an earlier revision) is compiled under its own module name beside this
tree's, and both builds' ``LayerStep.run`` are timed on the same plan and caches, call by call in
alternation with the fastest dense path (paired medians: drift of a noisy machine hits all alike).
The baseline is driven through the positional boundary of revision 6496b39 (``StepPlan(plan
tensors, buffers)``, a 15-value ``LayerStep``); both outputs are compared. This tree's whole
``LouverDecode.run`` is timed too (the wrapper's Python overhead over the bare kernel call).

    python -m benchmarks.ab_cpu_kernels --baseline-src ../before/kernels/cpu \
        --trace data/traces/bible_32768.pt --out benchmarks/results/decode_api_ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import date
from pathlib import Path

import torch

from louver_kernels.cpu_ops import DEFAULT_CACHE
from louver_sgl import LouverConfig, PageIndexStore
from louver_sgl.data.paged import load_trace, paged_batch
from louver_sgl.decode import LouverDecode
from louver_sgl.decode import threshold as th
from louver_sgl.decode.contract import gates_values
from louver_sgl.decode.fused import _Outputs, compiled_ops, page_chunks
from louver_sgl.decode.plan import plan_decode

from .decode_cpu import INDEXES, dense_variants, timeit

POLICIES = {"budget-0.05": dict(policy="budget", budget=0.05), "certified-1e-2": dict(policy="certified", eps=1e-2),
            "certified-1e-3": dict(policy="certified", eps=1e-3)}


def build_baseline(source_dir: Path):
    """The baseline sources compiled as module ``louver_grid_decode_baseline``."""
    from torch.utils import cpp_extension

    build = DEFAULT_CACHE.parent / "baseline" / Path(source_dir).resolve().as_posix().replace("/", "_")
    build.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(name="louver_grid_decode_baseline", sources=[str(p) for p in sorted(Path(source_dir).glob("*.cpp"))],
                              extra_cflags=["-O3", "-march=native", "-fopenmp", "-DAT_PARALLEL_OPENMP=1"],
                              extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)


def baseline_step(ops, pb, store, config):
    """The baseline build's LayerStep.run through its positional boundary (buffers of its own)."""
    plan = plan_decode(pb.page_table, pb.seq_lens, config)
    chunks = page_chunks(plan, 64)
    heads = pb.q.shape[1]
    part = _Outputs(plan.batch_size, heads, pb.k.shape[1], pb.v.shape[2], len(chunks[0]), len(plan.dense_slots),
                    config.sample_size)
    step_plan = ops.StepPlan([plan.dense_slots, plan.dense_req, plan.sample_slots, plan.sample_req, plan.page_ids,
                              *chunks, plan.num_indexed, plan.page_req],
                             [torch.empty(plan.batch_size, heads, pb.q.shape[2]), *(part.named()[n] for n in part.NAMES)])
    t_static = th.static_threshold_value(config)
    meta = store.tensors
    layer = ops.LayerStep(pb.k, pb.v, meta["lo"], meta["scale"], meta["radius"], meta["codes"], float(pb.sigma),
                          float(config.budget if config.policy == "budget" else -1.0),
                          0.0 if t_static is None else t_static, gates_values(config), config.grid_bits,
                          config.page_size, float(config.dense_fallback_fraction),
                          config.eps * th.BUDGET_SAFETY if config.policy == "certified" else -1.0, th.HIST_ROUNDING)
    return lambda: layer.run(pb.q, step_plan, None)


def run_case(trace, layer: int, batch: int, old_ops, rounds: int) -> list[dict]:
    base = INDEXES["grid-4bit-p128"]
    pb = paged_batch(trace, layer, batch, base["page_size"], huge_pages=True)
    variants = dense_variants(pb, True)
    best = min(variants, key=lambda n: timeit(variants[n], 5))
    rows = []
    for name, policy in POLICIES.items():
        config = LouverConfig(**base, **policy)
        store = PageIndexStore(config, len(pb.k) // config.page_size, pb.k.shape[1], pb.k.shape[2], pb.k.dtype)
        store.build_pages(pb.k, torch.arange(store.num_pages))
        decode = LouverDecode(config, "cpu", impl="cpu").plan(pb.page_table, pb.seq_lens)
        decode.run(pb.q, pb.k, pb.v, store, pb.sigma)  # makes the layer and plan sides
        (compiled,) = decode.impl.layers.values()
        side = decode.current_plan.derived[compiled.plan_key]
        fns = {"dense": variants[best], "old": baseline_step(old_ops, pb, store, config),
               "new": lambda: compiled.layer.run(pb.q, side[2], None),
               "new_wrapper": lambda: decode.run(pb.q, pb.k, pb.v, store, pb.sigma, stats=True)}
        equal = torch.equal(fns["old"]()[0], fns["new"]()[0])
        ms = alternating_medians(fns, rounds)
        rows.append({"layer": layer, "batch": batch, "policy": name, "dense": best,
                     **{f"{k}_ms": v for k, v in ms.items()}, "old_over_new": ms["old"] / ms["new"],
                     "wrapper_overhead_ms": ms["new_wrapper"] - ms["new"], "outputs_equal": equal})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def alternating_medians(fns: dict, rounds: int) -> dict:
    """Median ms of each function, called in alternation (order reversed every other round)."""
    names = list(fns)
    times = {n: [] for n in names}
    for r in range(rounds + 2):  # two warm-up rounds
        for n in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            fns[n]()
            if r >= 2:
                times[n].append(1e3 * (time.perf_counter() - start))
    return {n: statistics.median(t) for n, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-src", required=True, type=Path)
    parser.add_argument("--trace", default="data/traces/bible_32768.pt")
    parser.add_argument("--layers", type=int, nargs="+", default=[9, 21])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", default="benchmarks/results/decode_api_ab.json")
    args = parser.parse_args()
    if compiled_ops() is None:
        raise SystemExit("this tree's compiled CPU kernels do not build here")
    old_ops = build_baseline(args.baseline_src)
    trace = load_trace(args.trace)
    rows = [row for layer in args.layers for batch in args.batches
            for row in run_case(trace, layer, batch, old_ops, args.rounds)]
    command = (f"python -m benchmarks.ab_cpu_kernels --baseline-src {args.baseline_src} --trace {args.trace} "
               f"--layers {' '.join(map(str, args.layers))} --batches {' '.join(map(str, args.batches))} "
               f"--rounds {args.rounds} --out {args.out}")
    Path(args.out).write_text(json.dumps({"date": str(date.today()), "command": command, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
