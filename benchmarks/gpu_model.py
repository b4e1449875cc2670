"""Cost model of a louver decode step on a GPU: bytes each kernel moves and the time they take at
a given HBM bandwidth, next to dense attention's (FlashInfer's) bytes. Predictions, not
measurements.

The step modelled is the streaming design of the GPU plan (docs/gpu.md, "Next kernels"): a filter
pass over every indexed page's codebook and codes that compacts survivors (candidate token ids)
into per-(request, KV head) lists, then attention over the survivors (their K rows, the V rows of
the attended ones) and the dense part (sink, recent pages, tail), with the exact part (dense part
and sample K rows) first. Fractions of keys come from measurements: ``union`` (K rows read: the
GQA union of candidates) and ``attended`` (V rows) per policy and code width, from the H200 run
(8-bit grid, ``benchmarks/results/gpu/h200_run4.json``) and the CPU decode benchmark (4-bit grid,
SmolLM2 traces at 32K, ``benchmarks/results/decode_cpu_avx2.json``); for contexts and batches a
source did not measure, its 32K value is used (stated in each row).

    python -m benchmarks.gpu_model --out benchmarks/results/gpu/model.json            # the table
    python -m benchmarks.gpu_model --check benchmarks/results/gpu/h200_runN.json      # achieved vs predicted
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from benchmarks.record import write_result

SHAPES = {"smollm2": dict(heads_q=9, heads_kv=3, dim=64), "llama3_8b": dict(heads_q=32, heads_kv=8, dim=128)}
CONTEXTS = (8192, 32768, 131072)
BATCHES = (1, 8, 32)
ELEM = 2  # bf16 K/V
PAGE = 64
SINK_PAGES, RECENT_PAGES, SAMPLE = 1, 1, 256
# Measured bandwidth ceilings on the H200 (docs/gpu.md): what FlashInfer reached on the dense bytes
# at 128K, and the nominal HBM3e figure.
FLASHINFER_GBPS, NOMINAL_GBPS = 3870.0, 4300.0
LAUNCH_US = 2.5  # per kernel launch inside a CUDA graph
# (bits, policy) -> (union, attended, source)
FRACTIONS = {
    (8, "budget-0.05"): (0.125, 0.043, "h200_run4.json, 32K and 128K (8-bit, page 64)"),
    (8, "certified-1e-3"): (0.104, 0.053, "h200_run4.json, llama3_8b shape at 128K (8-bit)"),
    (4, "budget-0.05"): (0.21, 0.045, "decode_cpu_avx2.json, SmolLM2 32K layers 9/21 (4-bit, page 64)"),
    (4, "certified-1e-3"): (0.47, 0.47, "decode_cpu_avx2.json, SmolLM2 32K layers 9/21 (4-bit): diffuse heads"),
}


@dataclass
class Prediction:
    shape: str
    context: int
    batch: int
    bits: int
    policy: str
    dense_bytes: float
    exact_bytes: float
    filter_bytes: float
    attend_bytes: float
    louver_bytes: float
    bytes_vs_dense: float
    dense_us: float
    louver_us: float
    predicted_speedup: float
    fractions_from: str


def predict(shape: str, context: int, batch: int, bits: int, policy: str, gbps: float = FLASHINFER_GBPS) -> Prediction:
    s = SHAPES[shape]
    h_kv, dim = s["heads_kv"], s["dim"]
    union, attended, source = FRACTIONS[(bits, policy)]
    pages = context // PAGE
    dense_tokens = (SINK_PAGES + RECENT_PAGES) * PAGE + context % PAGE
    indexed = context - dense_tokens
    row = dim * ELEM
    per_head = {
        "dense": context * 2 * row,
        # dense part's and sample's K rows (their V rows are read by the attention)
        "exact": (dense_tokens + SAMPLE) * row,
        # page table entry, lo/scale/radius codebook, codes; survivors written and read back (4 B each)
        "filter": pages * (4 + 3 * row) + indexed * dim * bits / 8 + 2 * 4 * union * indexed,
        "attend": union * indexed * row + attended * indexed * row + dense_tokens * row,
    }
    total = {k: v * batch * h_kv for k, v in per_head.items()}
    louver = total["exact"] + total["filter"] + total["attend"]
    to_us = lambda nbytes: 1e6 * nbytes / (gbps * 1e9)  # noqa: E731
    dense_us = to_us(total["dense"]) + LAUNCH_US
    louver_us = to_us(louver) + 4 * LAUNCH_US  # exact part, filter (+ certificate check), attend, merge
    return Prediction(shape, context, batch, bits, policy, total["dense"], total["exact"], total["filter"],
                      total["attend"], louver, louver / total["dense"], dense_us, louver_us, dense_us / louver_us,
                      source)


def table(gbps: float) -> list[Prediction]:
    return [predict(shape, ctx, b, bits, policy, gbps) for shape in SHAPES for ctx in CONTEXTS for b in BATCHES
            for bits, policy in FRACTIONS]


def check(results_path: Path, gbps: float) -> list[dict]:
    """Achieved (a GPU results file in gpu_bench's schema) vs predicted, row by row."""
    rows = []
    for t in json.loads(results_path.read_text())["timings"]:
        if not t["method"].startswith("louver"):
            continue
        policy = "budget-0.05" if "budget0.05" in t["method"] else "certified-1e-3" if "cert1e-3" in t["method"] else None
        bits = t["config"]["grid_bits"]
        if policy is None or (bits, policy) not in FRACTIONS:
            continue
        p = predict(t["shape"], t["context"], t["batch"], bits, policy, gbps)
        rows.append({"shape": t["shape"], "context": t["context"], "batch": t["batch"], "method": t["method"],
                     "achieved_us": 1e3 * t["ms"], "predicted_us": p.louver_us,
                     "achieved_over_predicted": 1e3 * t["ms"] / p.louver_us,
                     "achieved_gbps": t.get("achieved_gbps"), "flashinfer_us": 1e3 * t["flashinfer_ms"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gbps", type=float, default=FLASHINFER_GBPS, help="bandwidth the model assumes")
    parser.add_argument("--check", type=Path, help="a GPU results file: print achieved vs predicted")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.check:
        rows = check(args.check, args.gbps)
        for r in rows:
            print(f"{r['shape']:9} {r['context']:>6} b{r['batch']:<2} {r['method']:24} achieved {r['achieved_us']:8.1f} us  "
                  f"predicted {r['predicted_us']:8.1f} us  ratio {r['achieved_over_predicted']:5.2f}")
        return
    rows = table(args.gbps)
    print("shape context batch bits policy | louver/dense bytes | predicted us (louver, dense) | speedup")
    for p in rows:
        print(f"{p.shape} {p.context} {p.batch} {p.bits} {p.policy} | {p.bytes_vs_dense:.3f} | "
              f"{p.louver_us:.1f}, {p.dense_us:.1f} | {p.predicted_speedup:.2f}")
    if args.out:
        write_result(args.out, {"kind": "prediction (cost model), not a measurement", "gbps": args.gbps,
                                "rows": [asdict(p) for p in rows]})


if __name__ == "__main__":
    main()
