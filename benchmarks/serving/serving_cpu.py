"""Serving benchmark with SGLang's own tools: louver vs torch_native on SmolLM2, CPU.

For each backend: start ``python -m sglang.launch_server`` and run ``python -m
sglang.benchmark.serving`` on random-token prompts of ~2K and ~8K tokens and on a
generated-shared-prefix workload (one shared system prompt, several questions); then
``python -m sglang.benchmark.one_batch`` (no server) at 2K and 8K. Records decode throughput,
time to first token with and without shared prefixes, louver's index pages built vs reused, and
the index memory line of the server log, in one JSON file.

    python -m benchmarks.serving.serving_cpu --out benchmarks/results/serving_cpu_fp16_2k_8k.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

from louver_kernels.cpu_ops import cpu_model_name
from louver_eval.data.fetch_model import ensure_model
from louver_eval.server import sglang_server

WORKLOADS = {
    "random-2k": ["--dataset-name", "random-ids", "--random-input-len", "2000", "--random-output-len", "32",
                  "--random-range-ratio", "1.0", "--num-prompts", "4"],
    "random-8k": ["--dataset-name", "random-ids", "--random-input-len", "7800", "--random-output-len", "32",
                  "--random-range-ratio", "1.0", "--num-prompts", "2"],
    "shared-prefix-2k": ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "1",
                         "--gsp-prompts-per-group", "4", "--gsp-system-prompt-len", "1900",
                         "--gsp-question-len", "100", "--gsp-output-len", "32", "--gsp-fast-prepare"],
}
KEYS = ("output_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "duration")


def bench_serving(url: str, model: Path, workload: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--base-url", url,
           "--tokenizer", str(model), "--model", str(model), "--request-rate", "inf", "--seed", "1",
           "--output-file", str(out), *workload]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=1800)
    result = json.loads(out.read_text().strip().splitlines()[-1])
    return {k: result.get(k) for k in KEYS}


def one_batch(model: Path, backend: str, input_len: int, env: dict[str, str]) -> dict:
    """``sglang.benchmark.one_batch`` (through benchmarks.serving.one_batch_plugins): prefill and median
    decode throughput of one request, from its last (measured, post-warm-up) run."""
    cmd = [sys.executable, "-m", "benchmarks.serving.one_batch_plugins", "--model-path", str(model), "--device", "cpu",
           "--attention-backend", backend, "--batch-size", "1", "--input-len", str(input_len),
           "--output-len", "16", "--max-total-tokens", "20000"]
    with tempfile.TemporaryDirectory() as tmp:  # one_batch appends a result file of its own; not ours
        cmd += ["--result-filename", str(Path(tmp) / "one_batch.jsonl")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env={**os.environ, **env})
    text = proc.stdout + proc.stderr
    prefill = re.findall(r"Prefill\. latency: ([0-9.]+) s, throughput: +([0-9.]+) token/s", text)
    decode = re.findall(r"Decode\. +median latency: ([0-9.]+) s, median throughput: +([0-9.]+) token/s", text)
    return {"prefill_s": _last([p[0] for p in prefill]), "prefill_tok_s": _last([p[1] for p in prefill]),
            "decode_median_s": _last([d[0] for d in decode]), "decode_tok_s": _last([d[1] for d in decode]),
            "returncode": proc.returncode}


def _last(values: list[str]):
    return float(values[-1]) if values else None


def run_backend(model: Path, backend: str, tmp: Path, port: int) -> dict:
    stats = tmp / f"{backend}-stats.json"
    env = {"LOUVER_STATS_FILE": str(stats)} if backend == "louver" else {}
    log = tmp / f"{backend}.log"
    result = {}
    with sglang_server(model, backend, port, env, log_path=log) as url:
        for name, workload in WORKLOADS.items():
            result[name] = bench_serving(url, model, workload, tmp / f"{backend}-{name}.jsonl")
    if stats.exists():
        result["index_pages"] = json.loads(stats.read_text())
    memory = re.findall(r"louver: index memory .*", log.read_text())
    result["index_memory_log"] = memory[-1] if memory else None
    result["one_batch"] = {str(n): one_batch(model, backend, n, env) for n in (2048, 7800)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/serving_cpu_fp16_2k_8k.json")
    parser.add_argument("--one-batch-only", action="store_true", help="rerun one_batch into an existing --out")
    args = parser.parse_args()
    model = ensure_model()
    if args.one_batch_only:
        results = json.loads(Path(args.out).read_text())
        for backend in ("torch_native", "louver"):
            results[backend]["one_batch"] = {str(n): one_batch(model, backend, n, {}) for n in (2048, 7800)}
            Path(args.out).write_text(json.dumps(results, indent=1))
        print(json.dumps({b: results[b]["one_batch"] for b in ("torch_native", "louver")}, indent=1))
        return
    results = {"date": str(date.today()), "cpu": cpu_model_name(), "model": "SmolLM2-135M-Instruct (Q4_1 dequantized)",
               "command": "python -m benchmarks.serving.serving_cpu", "workloads": WORKLOADS}
    with tempfile.TemporaryDirectory() as tmp:
        for port, backend in ((31881, "torch_native"), (31882, "louver")):
            results[backend] = run_backend(model, backend, Path(tmp), port)
            Path(args.out).write_text(json.dumps(results, indent=1))
    print(json.dumps({b: {w: results[b][w] for w in WORKLOADS} for b in ("torch_native", "louver")}, indent=1))


if __name__ == "__main__":
    main()
