"""Soak: mixed traffic on the CPU louver server for a fixed time; memory must stay flat.

Rounds of ``louver_eval.churn`` traffic (shared prefixes, mixed lengths, dropped streams)
over a small KV pool, back to back, for ``--minutes``. After every round it records the resident
memory of the server's processes (the scheduler holds the KV pool and the index) and the index
counters; at the end it checks that no request failed and that the scheduler's resident memory
did not grow beyond ``--rss-slack-mib`` over the first round's.

    python -m benchmarks.serving.soak_cpu --minutes 15 --out benchmarks/results/soak_cpu.json
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
import time
from datetime import date
from pathlib import Path

import psutil

from louver_kernels.cpu_ops import cpu_model_name
from louver_eval.data.fetch_model import ensure_model
from louver_eval.data.texts import load_text
from louver_eval.churn import ChurnPlan, run_churn
from louver_eval.server import sglang_server

# the dense fallback off: every decode step reads its pages through the index
ENV = {"LOUVER_PROFILE": "none", "LOUVER_PAGE_SIZE": "16", "LOUVER_MIN_SPARSE_TOKENS": "0",
       "LOUVER_DENSE_FALLBACK_FRACTION": "1.0"}
ARGS = ["--dtype", "float32", "--max-total-tokens", "6000", "--max-running-requests", "8"]


def server_rss_mib(port: int) -> dict[str, float]:
    """Resident MiB of the processes serving ``port`` and their children, by process name."""
    owner = next((c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port
                  and c.status == psutil.CONN_LISTEN), None)
    if owner is None:
        return {}
    root = psutil.Process(owner)
    procs = [root, *root.children(recursive=True)]
    return {f"{p.name()}[{p.pid}]": p.memory_info().rss / 2**20 for p in procs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--rss-slack-mib", type=float, default=64.0)
    parser.add_argument("--out", default="benchmarks/results/soak_cpu.json")
    args = parser.parse_args()
    text, rounds = load_text("bible"), []
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        stats = Path(tmp) / "stats.json"
        with sglang_server(ensure_model(), "louver", port, {**ENV, "LOUVER_STATS_FILE": str(stats)}, ARGS,
                           log_path=Path(tmp) / "server.log") as url:
            end = time.time() + 60 * args.minutes
            while time.time() < end:
                result = run_churn(url, text, ChurnPlan(seed=len(rounds)))
                rounds.append({"t_s": round(time.time() - end + 60 * args.minutes, 1), "completed": result.completed,
                               "dropped": result.dropped, "failed": len(result.failed),
                               "rss_mib": server_rss_mib(port), "index": json.loads(stats.read_text())})
                print(json.dumps(rounds[-1]), flush=True)
            memory_log = [line for line in (Path(tmp) / "server.log").read_text().splitlines() if "louver:" in line
                          and ("memory" in line or "cell" in line)]
    report(rounds, memory_log, args)


def report(rounds: list[dict], memory_log: list[str], args) -> None:
    sched = lambda r: max((v for k, v in r["rss_mib"].items() if "scheduler" in k), default=0.0)  # noqa: E731
    growth = sched(rounds[-1]) - sched(rounds[0]) if rounds else 0.0
    result = {"date": str(date.today()), "cpu": cpu_model_name(), "minutes": args.minutes,
              "command": f"python -m benchmarks.serving.soak_cpu --minutes {args.minutes} --out {args.out}",
              "server_env": ENV, "server_args": ARGS, "rounds": rounds, "index_memory_log": memory_log,
              "requests": sum(r["completed"] + r["dropped"] + r["failed"] for r in rounds),
              "failed": sum(r["failed"] for r in rounds), "scheduler_rss_growth_mib": growth}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("rounds",)}, indent=1))
    if result["failed"] or growth > args.rss_slack_mib:
        raise SystemExit(f"soak failed: {result['failed']} failed requests, scheduler RSS grew {growth:.0f} MiB")


if __name__ == "__main__":
    main()
