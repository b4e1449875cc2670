"""What an idle server burns, and what sleeping when idle costs a request: paired, on CPU.

For each setting (SGLang's scheduler polling while idle, ``LOUVER_SLEEP_ON_IDLE=0``, or the
backend's CPU default, which turns on SGLang's ``--sleep-on-idle``), in the order
A B A B: start the main command's server (SmolLM2 fp32, YaRN 32K context, louver), let it settle,
measure the CPU time all its processes take over ``--idle-seconds`` of idleness (cores = CPU
seconds / wall seconds), then run ``sglang.benchmark.serving`` on short random-token prompts at
concurrency 1 (TTFT and TPOT). One JSON file with every run.

    python -m benchmarks.serving.idle_cpu --out benchmarks/results/idle_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import psutil

from louver_eval.data.fetch_model import ensure_model
from louver_kernels.cpu_ops import cpu_model_name
from louver_eval.server import free_port, sglang_server

from benchmarks.record import write_result
from benchmarks.serving.serving_cpu import bench_serving

YARN = json.dumps({"max_position_embeddings": 32768, "rope_parameters": {
    "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192, "rope_theta": 100000.0}})
# setting -> louver's environment: SGLang's default (its scheduler polls while idle), or the
# backend's CPU default, which turns on --sleep-on-idle (logged at startup)
SETTINGS = {"spinning": {"LOUVER_SLEEP_ON_IDLE": "0"}, "sleep-on-idle": {}}


def server_cpu_seconds(url_port: int) -> float:
    """CPU seconds (user + system) of the server listening on ``url_port`` and all its children."""
    owner = next(c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == url_port
                 and c.status == psutil.CONN_LISTEN and c.pid)
    root = psutil.Process(owner)
    while root.parent() is not None and root.parent().pid != os.getpid() and "sglang" in " ".join(root.parent().cmdline()):
        root = root.parent()
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            total += times.user + times.system + getattr(times, "children_user", 0) + getattr(times, "children_system", 0)
        except psutil.NoSuchProcess:
            continue
    return total


def idle_cores(port: int, seconds: float, settle: float) -> float:
    time.sleep(settle)
    start_cpu, start = server_cpu_seconds(port), time.monotonic()
    time.sleep(seconds)
    return (server_cpu_seconds(port) - start_cpu) / (time.monotonic() - start)


def run_once(model: Path, setting: str, args: argparse.Namespace, logs: Path, index: int) -> dict:
    port = free_port()
    env = {"LOUVER_STATS_FILE": str(logs / f"stats-{setting}-{index}.json"), **SETTINGS[setting]}
    extra = ["--dtype", "float32", "--json-model-override-args", YARN]
    with sglang_server(model, "louver", port, env, extra, log_path=logs / f"server-{setting}-{index}.log",
                       max_total_tokens=65536) as url:
        cores = idle_cores(port, args.idle_seconds, args.settle)
        workload = ["--dataset-name", "random-ids", "--random-input-len", str(args.input_len), "--random-output-len",
                    str(args.output_len), "--random-range-ratio", "1.0", "--num-prompts", str(args.prompts),
                    "--max-concurrency", "1"]
        bench = bench_serving(url, model, workload, logs / f"bench-{setting}-{index}.jsonl")
        cores_after = idle_cores(port, args.idle_seconds, args.settle)
    return {"setting": setting, "run": index, "idle_cores": cores, "idle_cores_after_load": cores_after, **bench}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/idle_cpu.json")
    parser.add_argument("--pairs", type=int, default=2, help="A B rounds (each starts both servers once)")
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after start (or load) before measuring")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--log-dir", default="/tmp/idle-cpu-logs")
    args = parser.parse_args()
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    model = ensure_model()
    runs = []
    for index in range(args.pairs):
        for setting in SETTINGS:
            runs.append(run_once(model, setting, args, logs, index))
            print(json.dumps(runs[-1]), flush=True)
    summary = {s: {k: statistics.mean(r[k] for r in runs if r["setting"] == s)
                   for k in ("idle_cores", "idle_cores_after_load", "mean_ttft_ms", "mean_tpot_ms")} for s in SETTINGS}
    write_result(args.out, {"machine": {"cpu": cpu_model_name(), "cores": os.cpu_count()},
                            "settings": {k: v for k, v in vars(args).items() if k != "out"}, "summary": summary,
                            "runs": runs})
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
