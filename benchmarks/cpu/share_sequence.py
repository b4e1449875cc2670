"""The a-posteriori estimate share over consecutive decode steps: fixed shares against the share control.

A trace's N captured queries per layer are N consecutive decode steps of one request (positions
L − N … L − 1; N = 16 by default, ``capture --num-queries`` for more). Each step runs at batch 1
over its own context, in order, under the certified one-pass rule a posteriori (8-bit grid, page
128, fp16 KV) with either a fixed estimate share or ``decode.share_control.ShareControl`` (start
``estimate_share``, up to ``estimate_share_max``), whose state carries from step to step as in
the server. Each step is timed in alternation with the fastest dense path over the same context
(``fastest_dense``: the quickest of the decode benchmark's dense variants on the first step, K/V
pre-gathered onto huge pages as louver's pool is) and checked: recall against fp64 (must be 1.0)
and the reported bound (≤ ε). A row sums the N steps: louver ms, dense ms (and the dense variant's
name), their ratio, the steps with a lowered head (the request attended again), the mean GQA-union
fraction and the shares the steps ran at.

    python -m louver_eval.data.capture --text bible --lengths 16384 --num-queries 128 --out data/traces_q128
    python -m benchmarks.cpu.share_sequence --traces data/traces_q128/bible_16384.pt --layers 9 15 21 \\
        --controls s3 s4 s5.7 s4-max16 --rounds 3 --out benchmarks/results/share_sequence_q128_avx2.json
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import date
from pathlib import Path

import torch
from tqdm import tqdm

from louver_eval.data.paged import PagedBatch, load_trace, paged_batch
from louver_kernels.cpu_ops import cpu_model_name
from louver_sgl import LouverConfig, PageIndexStore
from louver_sgl.decode import LouverDecode
from louver_sgl.decode.plan import plan_decode
from louver_sgl.decode.share_control import ShareControl

from .decode_cpu import dense_variants, recall_of_step, timeit, timeit_alternating

INDEX = {"family": "grid", "grid_bits": 8, "page_size": 128}
# name -> (estimate_share, estimate_share_max: 0 fixed; a fixed share above 8, the config's cap, runs
# as a per-request share through LouverDecode.run)
CONTROLS = {
    "s3": (3.0, 0.0), "s4": (4.0, 0.0), "s5.7": (4.0 * 2 ** 0.5, 0.0), "s8": (8.0, 0.0), "s11": (8.0 * 2 ** 0.5, 0.0),
    "s16": (16.0, 0.0),
    "s3-max16": (3.0, 16.0), "s4-max16": (4.0, 16.0), "s8-max16": (8.0, 16.0), "s8-max32": (8.0, 32.0),
}


def one_request(pb: PagedBatch, b: int) -> PagedBatch:
    """Request ``b`` of ``pb`` alone (its own pages of the shared pool)."""
    return PagedBatch(pb.q[b:b + 1], pb.k, pb.v, pb.page_table[b:b + 1], pb.seq_lens[b:b + 1], pb.sigma)


def fastest_dense(pb: PagedBatch) -> str:
    """The name of the fastest of ``decode_cpu.dense_variants`` on request 0 of ``pb`` (SDPA or bmm,
    per query head or GQA-grouped, fp32/fp16/bf16): which one wins depends on the machine (bf16 SDPA
    on the AVX2 EPYC, bf16 GQA bmm at 2-3x faster than bf16 SDPA on the AVX-512 one)."""
    variants = dense_variants(one_request(pb, 0), huge_pages=True, page_size=INDEX["page_size"])
    return min(variants, key=lambda name: timeit(variants[name], 5))


def dense_step(pb: PagedBatch, name: str):
    """Dense variant ``name`` of ``decode_cpu.dense_variants`` over the request's K/V, gathered here
    (untimed)."""
    dtype = getattr(torch, name.rsplit("-", 1)[1])
    return dense_variants(pb, huge_pages=True, dtypes=(dtype,), page_size=INDEX["page_size"])[name]


def run_sequence(pb: PagedBatch, store: PageIndexStore, eps: float, control_name: str, rounds: int,
                 dense_name: str = "sdpa-gqa-bfloat16") -> dict:
    """The N steps of one control in order, each paired with dense variant ``dense_name``
    (``fastest_dense``); see the module docstring."""
    start, top = CONTROLS[control_name]
    cfg = LouverConfig(**INDEX, policy="certified", eps=eps, certified_passes=1, certified_rule="a_posteriori",
                       estimate_share=min(start, 8.0), estimate_share_max=top)
    control = ShareControl(cfg) if cfg.adaptive_share else None
    row = {"control": control_name, "eps": eps, "dense": dense_name, "louver_ms": 0.0, "dense_ms": 0.0, "lowered_steps": 0,
           "shares": [], "union": [], "recall": 1.0, "bound_max": 0.0}
    for b in range(len(pb.seq_lens)):
        req = one_request(pb, b)
        share = control.shares([0]) if control is not None else torch.tensor([start], dtype=torch.float64)
        decode = LouverDecode(cfg, "cpu").plan(req.page_table, req.seq_lens)
        step = lambda: decode.run(req.q, req.k, req.v, store, req.sigma, stats=True,  # noqa: E731
                                  estimate_share=share if (control is not None or start > 8.0) else None)
        result = step()  # the step whose outcome moves the control (the timed repeats run the same share)
        dense = dense_step(req, dense_name)
        dense()
        ms = timeit_alternating({"dense": dense, "louver": step}, rounds)
        stats = result.stats
        if control is not None:
            control.update([0], stats.lowered, stats.mass_bound)
        row["louver_ms"] += ms["louver"]
        row["dense_ms"] += ms["dense"]
        row["lowered_steps"] += int(stats.lowered.any())
        row["shares"].append(float(share[0]))
        row["union"].append(float(stats.union_candidates[0]) / max(1, int(stats.num_indexed[0]) * pb.k.shape[1]))
        row["recall"] = min(row["recall"], recall_of_step(req, store, cfg, stats))
        row["bound_max"] = max(row["bound_max"], float(stats.mass_bound.max()))
    row["speedup"] = row["dense_ms"] / row["louver_ms"]
    row["union_mean"] = sum(row["union"]) / len(row["union"])
    return row


# the shares of the sweep: the control's ladder from 8 (×/÷ √2) and the default 3
LADDER = (1.0, 2 ** 0.5, 2.0, 3.0, 2 ** 1.5, 4.0, 2 ** 2.5, 8.0, 2 ** 3.5, 16.0, 2 ** 4.5, 32.0)


def sweep(pb: PagedBatch, store: PageIndexStore, eps: float) -> dict:
    """Untimed: every step at every share of ``LADDER`` (the N requests as one batch, each at the
    same share): per (share, step) whether a head was lowered, how many KV groups, the largest
    reported bound over eps, and the GQA-union fraction. The data a share control is designed on."""
    cfg = LouverConfig(**INDEX, policy="certified", eps=eps, certified_passes=1, certified_rule="a_posteriori")
    decode = LouverDecode(cfg, "cpu").plan(pb.page_table, pb.seq_lens)
    out = {"eps": eps, "shares": list(LADDER), "lowered": [], "lowered_groups": [], "bound_over_eps": [],
           "union": []}
    h_kv = pb.k.shape[1]
    for share in LADDER:
        stats = decode.run(pb.q, pb.k, pb.v, store, pb.sigma, stats=True,
                           estimate_share=torch.full((len(pb.seq_lens),), share, dtype=torch.float64)).stats
        out["lowered"].append(stats.lowered.any(1).tolist())
        # KV groups with a lowered head, per step (the compiled step attends those again)
        out["lowered_groups"].append(stats.lowered.view(len(pb.seq_lens), h_kv, -1).any(2).sum(1).tolist())
        out["bound_over_eps"].append((stats.mass_bound.max(1).values / eps).tolist())
        out["union"].append((stats.union_candidates / (stats.num_indexed * pb.k.shape[1]).clamp(min=1)).tolist())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", nargs="+", default=["data/traces/bible_32768.pt", "data/traces/random_8192.pt"])
    parser.add_argument("--layers", type=int, nargs="+", default=[9, 15, 21])
    parser.add_argument("--eps", type=float, nargs="+", default=[1e-2])
    parser.add_argument("--controls", nargs="+", default=list(CONTROLS), choices=list(CONTROLS))
    parser.add_argument("--rounds", type=int, default=5, help="timed (dense, louver) pairs per step")
    parser.add_argument("--sweep", action="store_true",
                        help="untimed: every step at every share of the ladder (rows hold per-step outcomes)")
    parser.add_argument("--out", default="benchmarks/results/share_sequence.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    options = [f"--{k}" if v is True else f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}"
               for k, v in vars(args).items() if v is not False]
    results = {"date": str(date.today()), "command": "python -m benchmarks.cpu.share_sequence " + " ".join(options),
        "machine": {"cpu": cpu_model_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                    "python": platform.python_version()}, "rows": []}
    for trace_path in args.traces:
        trace = load_trace(trace_path)
        for layer in tqdm(args.layers, desc=Path(trace_path).stem):
            pb = paged_batch(trace, layer, len(trace["query_positions"]), INDEX["page_size"], huge_pages=True)
            store = PageIndexStore(LouverConfig(**INDEX), len(pb.k) // INDEX["page_size"], pb.k.shape[1],
                                   pb.k.shape[2], pb.k.dtype)
            store.build_pages(pb.k, plan_decode(pb.page_table, pb.seq_lens, LouverConfig(**INDEX)).page_ids)
            if not args.sweep:  # warm-up: the first sequence of a process ran up to 2x slower
                dense_name = fastest_dense(pb)
                run_sequence(pb, store, args.eps[0], args.controls[0], 1, dense_name)
            for eps in args.eps:
                if args.sweep:
                    results["rows"].append({"trace": trace_path, "layer": layer, **sweep(pb, store, eps)})
                    Path(args.out).write_text(json.dumps(results, indent=1))
                    continue
                for name in args.controls:
                    row = run_sequence(pb, store, eps, name, args.rounds, dense_name)
                    row.update(trace=trace_path, layer=layer)
                    results["rows"].append(row)
                    print(f"{Path(trace_path).stem} L{layer} eps={eps:g} {name}: {row['speedup']:.2f}x, "
                          f"lowered {row['lowered_steps']}/{len(row['shares'])}, union {row['union_mean']:.3f}, "
                          f"recall {row['recall']}, bound {row['bound_max'] / eps:.3f}·eps")
                    out = Path(args.out)
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
