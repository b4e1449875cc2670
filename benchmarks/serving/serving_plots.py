"""Plots of the serving grid (``benchmarks.serving.serving_grid_cpu``): decode time per token (mean ITL),
TTFT and output throughput against input length per configuration and workload, and the decode
speedup of each louver policy over ``torch_native``.

    python -m benchmarks.serving.serving_plots --results benchmarks/results/serving_cpu.json --out docs/img/serving_cpu.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.serving.serving_grid_cpu import CONFIGS  # noqa: E402

COLOURS = {name: f"C{i}" for i, name in enumerate(CONFIGS)}  # one colour per configuration in every panel


def series(rows: list[dict], workload: str, concurrency: int, key: str,
           scale: float = 1.0) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r["workload"] == workload and r["concurrency"] == concurrency and r.get(key) is not None:
            out.setdefault(r["config"], []).append((r["input_len"], r[key] * scale))
    return {k: sorted(v) for k, v in out.items()}


def itl_key(rows: list[dict], workload: str, concurrency: int) -> str:
    """Median ITL where every row of the panel has it (it leaves out the waits behind other
    requests' prefill chunks that the mean averages in), else the mean."""
    panel = [r for r in rows if r["workload"] == workload and r["concurrency"] == concurrency]
    return "median_itl_ms" if all(r.get("median_itl_ms") is not None for r in panel) else "mean_itl_ms"


def speedups(rows: list[dict], workload: str, concurrency: int) -> dict[str, list[tuple[int, float]]]:
    key = itl_key(rows, workload, concurrency)
    base = {n: t for n, t in series(rows, workload, concurrency, key).get("torch_native", [])}
    out = {}
    for name, points in series(rows, workload, concurrency, key).items():
        if name != "torch_native":
            out[name] = [(n, base[n] / t) for n, t in points if n in base]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="benchmarks/results/serving_cpu.json")
    parser.add_argument("--out", default="docs/img/serving_cpu.png")
    parser.add_argument("--concurrency", type=int, default=1)
    args = parser.parse_args()
    data = json.loads(Path(args.results).read_text())
    rows = [r for r in data["rows"] if r["concurrency"] == args.concurrency]  # no empty workload panels
    workloads = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(len(workloads), 4, figsize=(18, 3.8 * len(workloads)), squeeze=False)
    for i, workload in enumerate(workloads):
        key = itl_key(rows, workload, args.concurrency)
        panels = ((series(rows, workload, args.concurrency, key), f"decode ms per token ({key.split('_')[0]} ITL)"),
                  (series(rows, workload, args.concurrency, "mean_ttft_ms", 1e-3), "mean TTFT (s)"),
                  (series(rows, workload, args.concurrency, "output_throughput"), "output tokens / s"),
                  (speedups(rows, workload, args.concurrency), "decode speedup vs torch_native"))
        for ax, (lines, label) in zip(axes[i], panels):
            for name, points in lines.items():
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name, color=COLOURS[name])
            ax.set_xscale("log", base=2)
            ax.set_xlabel("input tokens")
            ax.set_ylabel(label)
            ax.set_title(f"{workload}, concurrency {args.concurrency}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"sglang.bench_serving on {data.get('cpu', 'CPU')}, {data.get('model', '')} ({data.get('date', '')})")
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
