"""Two louver workers behind sglang-router: cache_aware against round_robin on shared prefixes.

For each policy: start the workers (the main command's server: SmolLM2 fp32, YaRN 32K, louver;
one core each) and the router, run ``sglang.benchmark.serving`` through the router on the
``generated-shared-prefix`` workload (several prefix groups of a few thousand tokens, several
questions per group, groups interleaved at random), then read every worker's statistics file:
index pages its prefills built and reused from its radix cache. One row per policy in
``--out`` (``rows``) and a plot.

    python -m benchmarks.serving.router_cpu --out benchmarks/results/router_cpu.json --plot docs/img/router_cpu.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from contextlib import ExitStack
from datetime import date
from pathlib import Path

from louver_eval.data.fetch_model import ensure_model
from louver_eval.router import POLICIES, louver_workers, sglang_router, start_all
from louver_eval.server import LONG_PREFILL_ARGS, YARN_32K_ARGS, free_port, stop_servers_on_sigterm
from louver_kernels.cpu_ops import cpu_model_name

from benchmarks.record import command_line

KEYS = ("completed", "duration", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
        "output_throughput", "request_throughput", "total_input_tokens")


def gsp_args(a: argparse.Namespace) -> list[str]:
    return ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(a.groups),
            "--gsp-prompts-per-group", str(a.per_group), "--gsp-system-prompt-len", str(a.prefix_len),
            "--gsp-question-len", str(a.question_len), "--gsp-output-len", str(a.output_len)]


def bench(url: str, model: Path, a: argparse.Namespace, out: Path) -> dict:
    """``sglang.benchmark.serving`` through the router; its summary keys (failed = sent - completed)."""
    cmd = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--base-url", url,
           "--tokenizer", str(model), "--model", str(model), "--request-rate", "inf", "--max-concurrency",
           str(a.concurrency), "--seed", "1", "--output-file", str(out), *gsp_args(a)]
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, timeout=7200)
    result = json.loads(out.read_text().strip().splitlines()[-1])
    return {k: result.get(k) for k in KEYS}


def worker_pages(stats_file: Path) -> dict:
    data = json.loads(stats_file.read_text())
    return {"index_pages_built": data["pages_built"], "index_pages_reused": data["pages_reused"],
            "requests": len(data.get("requests", {})), "decode_forwards": data["decode_forwards"]}


def run_policy(policy: str, model: Path, a: argparse.Namespace) -> dict:
    logs = Path(a.log_dir) / policy
    logs.mkdir(parents=True, exist_ok=True)
    workers = louver_workers(model, a.workers, logs, extra=["--dtype", "float32", *YARN_32K_ARGS, *LONG_PREFILL_ARGS])
    with ExitStack() as stack:
        for worker in workers:
            stack.callback(worker.stop)
        start_all(workers)
        url = stack.enter_context(sglang_router([w.url for w in workers], policy, free_port(), logs / "router.log"))
        result = bench(url, model, a, logs / "bench.jsonl")
    per_worker = [worker_pages(logs / f"stats-{i}.json") for i in range(len(workers))]
    sent = a.groups * a.per_group
    return {"policy": policy, "workers": a.workers, "groups": a.groups, "questions_per_group": a.per_group,
            "prefix_tokens": a.prefix_len, "requests": sent, "completed": result["completed"],
            "failed": sent - (result["completed"] or 0),
            "index_pages_built": sum(w["index_pages_built"] for w in per_worker),
            "index_pages_reused": sum(w["index_pages_reused"] for w in per_worker),
            **{k: result[k] for k in KEYS if k != "completed"}, "per_worker": per_worker}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    short = {"cache_aware": "cache-aware", "round_robin": "round-robin"}
    names = [f"{short[r['policy']]}\n{r['questions_per_group']} q/group" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    axes[0].bar(names, [r["index_pages_reused"] for r in rows], label="reused", color="tab:green")
    axes[0].bar(names, [r["index_pages_built"] for r in rows], bottom=[r["index_pages_reused"] for r in rows],
                label="built", color="tab:gray")
    axes[0].set_title("index pages (both workers)")
    axes[0].legend()
    axes[1].bar(names, [r["mean_ttft_ms"] / 1e3 for r in rows], color="tab:blue")
    axes[1].set_title("mean TTFT (s)")
    axes[2].bar(names, [r["output_throughput"] for r in rows], color="tab:orange")
    axes[2].set_title("output throughput (tok/s)")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("2 louver workers behind sglang-router, shared-prefix workload (6K-token prefixes), CPU")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/router_cpu.json")
    parser.add_argument("--plot", default="docs/img/router_cpu.png")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--per-group", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=4096)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--log-dir", default="/tmp/router-cpu-logs")
    parser.add_argument("--merge", action="store_true", help="add the rows to those already in --out")
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot from --out")
    a = parser.parse_args()
    if a.plot_only:
        plot(json.loads(Path(a.out).read_text())["rows"], Path(a.plot))
        return
    stop_servers_on_sigterm()
    model = ensure_model()
    rows = []
    for policy in a.policies:
        rows.append(run_policy(policy, model, a))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "per_worker"}), flush=True)
    run = {"command": command_line(), "date": str(date.today()),
           "settings": {k: v for k, v in vars(a).items() if k not in ("out", "plot", "merge")}}
    earlier = json.loads(Path(a.out).read_text()) if a.merge and Path(a.out).is_file() else {"runs": [], "rows": []}
    result = {"machine": {"cpu": cpu_model_name(), "cores": os.cpu_count()}, "date": run["date"],
              "commands": [r["command"] for r in earlier["runs"]] + [run["command"]],
              "runs": earlier["runs"] + [run], "rows": earlier["rows"] + rows}
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    plot(result["rows"], Path(a.plot))


if __name__ == "__main__":
    main()
