"""Accuracy vs keys attended on captured SmolLM2 traces: louver vs Quest, StreamingLLM, oracle top-k.

Every captured query of every captured layer of each trace is decoded by each method (one cache
cell per trace layer); louver runs with ``dense_fallback_fraction = 1`` so its points show the
true candidate fraction instead of jumping to dense. Writes per-method means over all cells.

    python -m benchmarks.quality.eval_tradeoff --out benchmarks/results/eval_tradeoff.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from louver_sgl.config import LouverConfig
from louver_eval.data.capture import ensure_traces, load_trace
from louver_eval.baselines import BASELINES
from louver_eval.cache import add_run_arguments, cached_cell, command_line, machine_info, write_json
from louver_eval.tradeoff import layer_tradeoff

LOUVER = ["budget-0.02", "budget-0.05", "budget-0.1", "budget-0.2", "budget-0.3",
          "certified-0.1", "certified-0.03", "certified-1e-2", "certified-1e-3", "certified-1e-4"]
FRACTIONS = [0.02, 0.05, 0.1, 0.2, 0.3, 0.5]
FULL_TRACES = [("bible", 2048), ("paul_graham", 2048), ("bible", 8192), ("paul_graham", 8192)]
SMALL = {"traces": [("bible", 2048)], "layers": [3, 21], "louver": ["budget-0.1", "certified-1e-2"],
         "fractions": [0.1]}


def combine(cells: list[dict]) -> dict:
    """Query-head-weighted means over cells, per method: fraction, mass, error (and bound share)."""
    out: dict[str, dict] = {}
    for cell in cells:
        for name, row in cell["methods"].items():
            acc = out.setdefault(name, {"query_heads": 0, "attended_fraction": 0.0, "dropped_mass": 0.0,
                                        "output_rel_error": 0.0, "max_dropped_mass": 0.0, "p99_output_rel_error": 0.0})
            acc["query_heads"] += row["query_heads"]
            for key in ("attended_fraction", "dropped_mass", "output_rel_error"):
                acc[key] += row[key]["sum"]
            acc["max_dropped_mass"] = max(acc["max_dropped_mass"], row["dropped_mass"]["max"])
            acc["p99_output_rel_error"] = max(acc["p99_output_rel_error"], row["output_rel_error"]["p99"])
            if "measured_le_bound" in row:
                acc["measured_le_bound"] = acc.get("measured_le_bound", 0) + row["measured_le_bound"]
    for acc in out.values():
        for key in ("attended_fraction", "dropped_mass", "output_rel_error"):
            acc[key] /= acc["query_heads"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, "tradeoff", "CI size: one 2K trace, two layers")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from tqdm import tqdm

    traces = SMALL["traces"] if args.small else FULL_TRACES
    louver = SMALL["louver"] if args.small else LOUVER
    fractions = SMALL["fractions"] if args.small else FRACTIONS
    base = LouverConfig(dense_fallback_fraction=1.0)
    cells = []
    for text, length in tqdm(traces, desc="traces"):
        (path,) = ensure_traces([length], text=text)
        trace = None
        layers = SMALL["layers"] if args.small else None
        for layer in layers or _trace_layers(path):
            cell_path = args.cache / f"{text}_{length}_layer{layer}.json"

            def compute(layer=layer):
                nonlocal trace
                trace = trace or load_trace(path)
                return {"trace": f"{text}_{length}", "layer": layer,
                        "methods": layer_tradeoff(trace, layer, louver, list(BASELINES), fractions, base)}

            cells.append(cached_cell(cell_path, compute))
    result = {"command": command_line("eval_tradeoff", args.small),
              "machine": machine_info(), "traces": [f"{t}_{n}" for t, n in traces],
              "cells": len(cells), "methods": combine(cells), "per_cell": cells}
    write_json(args.out, result)
    print(f"[tradeoff] {len(cells)} trace layers -> {args.out}")


def _trace_layers(path: Path) -> list[int]:
    return sorted(load_trace(path)["keys"])


if __name__ == "__main__":
    main()
