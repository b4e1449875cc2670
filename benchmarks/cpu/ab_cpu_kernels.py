"""Same-process A/B of two builds of the compiled CPU step on a captured trace.

The baseline build (``--baseline-src``: the kernels/cpu folder of another source tree, e.g. a
``git worktree`` of an earlier revision) is compiled under its own module name beside this
tree's, and both builds' ``LayerStep.run`` are timed on the same plan and caches, call by call in
alternation with the fastest dense path (paired medians: drift of a noisy machine hits all alike).
The baseline is driven through the named boundary of this tree's step (``StepPlan`` and
``LayerStep`` by keyword: a baseline from before that boundary does not load); both outputs are
compared (equal unless the change alters the arithmetic). This tree's whole
``LouverDecode.run`` is timed too (the wrapper's Python overhead over the bare kernel call).

    python -m benchmarks.cpu.ab_cpu_kernels --baseline-src ../before/kernels/cpu \
        --trace data/traces/bible_32768.pt --out benchmarks/results/decode_api_ab.json
"""

from __future__ import annotations

import argparse
import json
import re
from datetime import date
from pathlib import Path

import torch

from louver_kernels.cpu_ops import DEFAULT_CACHE
from louver_sgl import LouverConfig, PageIndexStore
from louver_eval.data.paged import load_trace, paged_batch
from louver_sgl.decode import LouverDecode
from louver_sgl.decode.impl_cpu import _layer_step, _Outputs, _step_plan, compiled_ops, page_chunks

from benchmarks.cpu.decode_cpu import INDEXES, dense_variants, timeit, timeit_alternating

POLICIES = {"budget-0.05": dict(policy="budget", budget=0.05),
            "budget-0.001": dict(policy="budget", budget=0.001),  # the scan alone (decode_cpu's floor)
            "certified-1e-2": dict(policy="certified", eps=1e-2),
            "certified-1e-2-a-posteriori": dict(policy="certified", eps=1e-2, certified_rule="a_posteriori"),
            "certified-1e-3": dict(policy="certified", eps=1e-3),
            "certified-1e-2-one-pass-a-posteriori": dict(policy="certified", eps=1e-2, certified_passes=1,
                                                         certified_rule="a_posteriori"),
            # shares whose checks fail on some steps of the captured text (the failure path: a second pass)
            **{f"certified-1e-2-one-pass-a-posteriori-s{name}": dict(
                policy="certified", eps=1e-2, certified_passes=1, certified_rule="a_posteriori", estimate_share=share)
               for name, share in (("5.7", 4 * 2 ** 0.5), ("8", 8.0))}}
DEFAULT_POLICIES = ("budget-0.05", "certified-1e-2", "certified-1e-2-a-posteriori", "certified-1e-3",
                    "certified-1e-2-one-pass-a-posteriori")


def build_baseline(source_dir: Path):
    """The baseline sources compiled as module ``louver_grid_decode_baseline``."""
    from torch.utils import cpp_extension

    build = DEFAULT_CACHE.parent / "baseline" / Path(source_dir).resolve().as_posix().replace("/", "_")
    build.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(name="louver_grid_decode_baseline", sources=[str(p) for p in sorted(Path(source_dir).glob("*.cpp"))],
                              extra_cflags=["-O3", "-march=native", "-fopenmp", "-DAT_PARALLEL_OPENMP=1"],
                              extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)


class _Named:
    """An ``_Outputs`` stand-in with a chosen set of buffers (``_step_plan`` reads ref and named())."""

    def __init__(self, buffers: dict, ref: torch.Tensor):
        self.buffers, self.ref = buffers, ref

    def named(self) -> dict:
        return self.buffers


def baseline_step(ops, pb, store, config, plan, chunk_pages: int, launch: dict | None = None):
    """The baseline build's LayerStep.run on its own plan side (buffers of its own), through the
    named boundary this tree's step has (``impl_cpu._layer_step`` / ``impl_cpu._step_plan``), with
    the new step's kernel ``launch`` (``CpuDecode._kernel_launch``: one scan or two), so that both
    builds run the same passes."""
    chunks = page_chunks(plan, chunk_pages)
    reserve = config.threshold.band_pass or bool((launch or {}).get("one_scan"))
    band = (len(plan.page_ids), plan.page_size) if reserve else None
    part = _Outputs(plan.batch_size, pb.q.shape[1], pb.k.shape[1], pb.v.shape[2], len(chunks[0]),
                    len(plan.dense_slots), config.sample_size, band=band)
    buffers = part.named()
    while True:  # buffers added since the baseline are left out (it refuses them by name)
        try:
            _, _, step_plan = _step_plan(ops, plan, chunks, _Named(buffers, part.ref), pb.q.shape[2])
            break
        except ValueError as exc:
            unknown = re.fullmatch(r"StepPlan: unknown argument '(\w+)'", str(exc))
            if unknown is None or unknown[1] not in buffers:
                raise
            buffers.pop(unknown[1])
    layer = _layer_step(ops, pb.k, pb.v, store, pb.sigma, config, launch)
    return lambda: layer.run(pb.q, step_plan, None)


def run_case(trace, layer: int, batch: int, old_ops, rounds: int, index: str,
             policies=DEFAULT_POLICIES, cold: bool = False) -> list[dict]:
    """Every policy's row of one layer and batch; ``cold``: each timed call follows an untimed
    call of the dense path."""
    base = INDEXES[index]
    pb = paged_batch(trace, layer, batch, LouverConfig(**base).page_size, huge_pages=True)
    variants = dense_variants(pb, True)
    best = min(variants, key=lambda n: timeit(variants[n], 5))
    rows = []
    for name in policies:
        config = LouverConfig(**base, **POLICIES[name])
        store = PageIndexStore(config, len(pb.k) // config.page_size, pb.k.shape[1], pb.k.shape[2], pb.k.dtype)
        store.build_pages(pb.k, torch.arange(store.num_pages))
        decode = LouverDecode(config, "cpu", impl="cpu").plan(pb.page_table, pb.seq_lens)
        decode.run(pb.q, pb.k, pb.v, store, pb.sigma)  # makes the layer and plan sides
        (compiled,) = decode.impl.layers.values()
        side = decode.current_plan.derived[compiled.plan_key]
        old = baseline_step(old_ops, pb, store, config, decode.current_plan, decode.impl.launch.chunk_pages,
                            decode.impl._kernel_launch)
        fns = {"dense": variants[best], "old": old,
               "new": lambda: compiled.layer.run(pb.q, side[2], None),
               "new_wrapper": lambda: decode.run(pb.q, pb.k, pb.v, store, pb.sigma, stats=True)}
        equal = torch.equal(fns["old"]()[0], fns["new"]()[0])
        # a new random order every round: a fixed or reversed one keeps one build next to the dense
        # path (which evicts the caches); cold: every call follows the dense path, so that every
        # build reads its codes from memory as in a server, where the other layers' reads come
        # between a layer's steps (without it a build often follows the other build or the wrapper,
        # which read the same codes)
        ms = timeit_alternating(fns, rounds, before=variants[best] if cold else None, shuffle=True, warmup_rounds=2)
        rows.append({"layer": layer, "batch": batch, "index": index, "policy": name, "dense": best,
                     **{f"{k}_ms": v for k, v in ms.items()}, "old_over_new": ms["old"] / ms["new"],
                     "wrapper_overhead_ms": ms["new_wrapper"] - ms["new"], "outputs_equal": equal, "cold": cold,
                     # requests whose check lowered a head (they attend again)
                     "lowered_requests": int(fns["new_wrapper"]().stats.lowered.any(1).sum())})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-src", required=True, type=Path)
    parser.add_argument("--trace", default="data/traces/bible_32768.pt")
    parser.add_argument("--layers", type=int, nargs="+", default=[9, 21])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--index", default="grid-8bit", choices=sorted(INDEXES))
    parser.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES), choices=list(POLICIES))
    parser.add_argument("--out", default="benchmarks/results/decode_api_ab.json")
    parser.add_argument("--cold", action="store_true",
                        help="every timed call follows an untimed dense call (codes read from memory)")
    args = parser.parse_args()
    if compiled_ops() is None:
        raise SystemExit("this tree's compiled CPU kernels do not build here")
    old_ops = build_baseline(args.baseline_src)
    trace = load_trace(args.trace)
    rows = [row for layer in args.layers for batch in args.batches
            for row in run_case(trace, layer, batch, old_ops, args.rounds, args.index, args.policies, args.cold)]
    command = (f"python -m benchmarks.cpu.ab_cpu_kernels --baseline-src {args.baseline_src} --trace {args.trace} "
               f"--layers {' '.join(map(str, args.layers))} --batches {' '.join(map(str, args.batches))} "
               f"--rounds {args.rounds} --index {args.index} --policies {' '.join(args.policies)}{' --cold' if args.cold else ''} --out {args.out}")
    Path(args.out).write_text(json.dumps({"date": str(date.today()), "command": command, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
