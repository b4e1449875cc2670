"""Serving grid with SGLang's own benchmark: louver policies vs torch_native, fp32, on CPU.

One server per configuration (``torch_native``, or louver with one policy), SmolLM2-135M in
fp32 with the main command's YaRN override past 8K tokens; for every input length, concurrency
and workload it runs ``python -m sglang.benchmark.serving`` (random token ids, or
``generated-shared-prefix``: one shared document of the input length minus the question, and
``max(2, concurrency)`` questions over it) and records one row: backend, policy, workload,
input_len, concurrency, mean TPOT / TTFT, output throughput, and for louver the index pages built
and reused during that row (from the statistics file). Rows are appended to ``--out`` as they
finish and a rerun skips the rows already there, so a long grid can be run in pieces.
``--configs budget-0.05-native-extend`` adds a TTFT control: louver's decode over SGLang's own
``torch_native`` extend, so its TTFT compares like for like with ``torch_native``'s.

    python -m benchmarks.serving.serving_grid_cpu --input-lens 8192 16384 32640 --concurrency 1 4 \\
        --out benchmarks/results/serving_cpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from datetime import date, datetime, timezone
from pathlib import Path

from louver_kernels.cpu_ops import cpu_model_name
from louver_eval.data.fetch_model import ensure_model
from louver_eval.server import free_port, generate, long_context_args, sglang_server
from benchmarks.record import command_line

# configuration name -> (backend, policy label, louver environment)
CONFIGS = {
    "torch_native": ("torch_native", None, {}),
    "budget-0.05": ("louver", "budget-0.05", {"LOUVER_POLICY": "budget", "LOUVER_BUDGET": "0.05"}),
    "certified-1e-3": ("louver", "certified-1e-3", {"LOUVER_POLICY": "certified", "LOUVER_EPS": "1e-3"}),
    "certified-1e-3-a-posteriori": ("louver", "certified-1e-3-a-posteriori",
                                    {"LOUVER_POLICY": "certified", "LOUVER_EPS": "1e-3",
                                     "LOUVER_CERTIFIED_RULE": "a_posteriori", "LOUVER_CERTIFIED_PASSES": "2"}),
    # the one-pass rule a posteriori (design notes, "Certified a posteriori in one pass")
    "certified-1e-3-one-pass-a-posteriori": ("louver", "certified-1e-3-one-pass-a-posteriori",
                                             {"LOUVER_POLICY": "certified", "LOUVER_EPS": "1e-3",
                                              "LOUVER_CERTIFIED_RULE": "a_posteriori",
                                              "LOUVER_CERTIFIED_PASSES": "1"}),
    "certified-1e-3-one-pass-a-posteriori-s1": ("louver", "certified-1e-3-one-pass-a-posteriori-s1",
                                                {"LOUVER_POLICY": "certified", "LOUVER_EPS": "1e-3",
                                                 "LOUVER_CERTIFIED_RULE": "a_posteriori",
                                                 "LOUVER_CERTIFIED_PASSES": "1", "LOUVER_ESTIMATE_SHARE": "1"}),
    # the one-pass rule at Z_lb (design notes, "Certified in one pass"): the AVX2 profiles' rule is a posteriori
    "certified-1e-3-one-pass": ("louver", "certified-1e-3-one-pass",
                                {"LOUVER_POLICY": "certified", "LOUVER_EPS": "1e-3",
                                 "LOUVER_CERTIFIED_RULE": "histogram", "LOUVER_CERTIFIED_PASSES": "1"}),
    # the certified histogram rule with two scans of the codes (the compiled step before its one-scan pass)
    "certified-1e-3-two-scans": ("louver", "certified-1e-3", {"LOUVER_POLICY": "certified", "LOUVER_EPS": "1e-3",
                                                              "LOUVER_ONE_SCAN": "0"}),
    # louver's decode over SGLang's own torch_native extend: TTFT like for like with torch_native
    # (louver's default CPU extend, torch_native_prefix, attends only the new queries and is faster)
    "budget-0.05-native-extend": ("louver", "budget-0.05", {"LOUVER_POLICY": "budget", "LOUVER_BUDGET": "0.05",
                                                            "LOUVER_EXTEND_BACKEND": "torch_native"}),
}
DEFAULT_CONFIGS = ["torch_native", "budget-0.05", "certified-1e-3"]
QUESTION_LEN = 100
# median ITL too: with several long prompts in flight, a request's decode steps wait behind the
# others' prefill chunks (tens of seconds each here), which the mean ITL averages in
KEYS = ("mean_tpot_ms", "mean_ttft_ms", "median_ttft_ms", "output_throughput", "mean_itl_ms", "median_itl_ms",
        "duration", "completed")


def prompt_count(concurrency: int, num_prompts: int | None) -> int:
    """Prompts per row: ``max(2, concurrency)`` unless given (one 32K prompt is ~20 min of prefill)."""
    return num_prompts if num_prompts is not None else max(2, concurrency)


def workload_args(workload: str, input_len: int, concurrency: int, output_len: int, prompts: int) -> list[str]:
    if prompts < concurrency:
        raise ValueError(f"{prompts} prompts cannot keep {concurrency} requests in flight")
    if workload == "random":
        return ["--dataset-name", "random-ids", "--random-input-len", str(input_len), "--random-output-len",
                str(output_len), "--random-range-ratio", "1.0", "--num-prompts", str(prompts)]
    if workload == "shared-prefix":
        return ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "1", "--gsp-prompts-per-group",
                str(prompts), "--gsp-system-prompt-len", str(input_len - QUESTION_LEN), "--gsp-question-len",
                str(QUESTION_LEN), "--gsp-output-len", str(output_len), "--gsp-fast-prepare"]
    raise ValueError(f"unknown workload {workload!r} (random, shared-prefix)")


def bench_serving(url: str, model: Path, args: list[str], concurrency: int, prompts: int, output_len: int,
                  out: Path) -> dict:
    cmd = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--base-url", url,
           "--tokenizer", str(model), "--model", str(model), "--request-rate", "inf", "--seed", "1",
           "--max-concurrency", str(concurrency), "--output-file", str(out),
           # bench_serving's warmup sends the first prompt itself, so the first measured request
           # would hit the radix cache: no warmup (the server was warmed once), cache flushed
           "--warmup-requests", "0", "--flush-cache", "--output-details",
           # token ids, not text: a random-id prompt decoded and re-tokenized grows by ~5 %
           # (32,640 ids became 34,214 tokens, past the 32K context)
           "--tokenize-prompt", *args]
    with out.with_suffix(".log").open("a") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, timeout=7200)
    result = json.loads(out.read_text().strip().splitlines()[-1])
    check_requests(result, prompts, output_len)
    return {k: result.get(k) for k in KEYS}


def check_requests(result: dict, prompts: int, output_len: int) -> None:
    """Refuse a row whose requests did not all run: bench_serving counts a request the server
    refused at once (e.g. prompt plus output past the context) as completed, with TTFT 0."""
    errors = [e for e in result.get("errors", []) if e]
    ttfts = result.get("ttfts", [])
    lens = result.get("output_lens", [])
    if (errors or result.get("completed") != prompts or len(ttfts) != prompts or min(ttfts, default=0) <= 0
            or any(n != output_len for n in lens)):
        raise RuntimeError(f"bench_serving row failed: completed {result.get('completed')} of {prompts}, "
                           f"ttfts {ttfts}, output lengths {lens} (want {output_len}), errors {errors[:2]}")


def read_pages(stats: Path) -> tuple[int, int]:
    try:
        data = json.loads(stats.read_text())
        return int(data.get("pages_built", 0)), int(data.get("pages_reused", 0))
    except (OSError, ValueError):
        return 0, 0


def row_key(row: dict) -> tuple:
    return row["config"], row["workload"], row["input_len"], row["concurrency"]


def run_config(name: str, cells: list[tuple[str, int, int]], model: Path, output_len: int,
               num_prompts: int | None, done: set, save, log_dir: str) -> None:
    backend, policy, env = CONFIGS[name]
    todo = [c for c in cells if (name, *c) not in done]
    if not todo:
        return
    longest = max(n for _, n, _ in todo)
    extra = ["--dtype", "float32", "--max-total-tokens", str(max(4 * longest + 4096, 40000)),
             *long_context_args(longest + output_len)]
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(log_dir) / name
        logs.mkdir(parents=True, exist_ok=True)
        stats = Path(tmp) / "stats.json"
        server_env = {**env, "LOUVER_STATS_FILE": str(stats)} if backend == "louver" else {}
        with sglang_server(model, backend, free_port(), server_env, extra, timeout=900,
                           log_path=logs / "server.log", max_total_tokens=None) as url:
            generate(url, "Warm up the server once before the measured rows.", max_new_tokens=8)
            for workload, input_len, concurrency in todo:
                before = read_pages(stats)
                prompts = prompt_count(concurrency, num_prompts)
                args = workload_args(workload, input_len, concurrency, output_len, prompts)
                result = bench_serving(url, model, args, concurrency, prompts, output_len, logs / "bench.jsonl")
                after = read_pages(stats)
                row = {"config": name, "backend": backend, "policy": policy, "workload": workload,
                       "input_len": input_len, "concurrency": concurrency, "output_len": output_len,
                       "num_prompts": prompts, "prompt_as_token_ids": True,
                       # this machine's speed differs between sessions: ratios only between rows
                       # measured close together
                       "measured_at": datetime.now(timezone.utc).isoformat(timespec="minutes"), **result}
                if backend == "louver":
                    row.update(index_pages_built=after[0] - before[0], index_pages_reused=after[1] - before[1])
                save(row)
                print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    parser.add_argument("--input-lens", nargs="+", type=int, default=[8192, 16384, 32640])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--workloads", nargs="+", default=["random", "shared-prefix"])
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="prompts per row (default max(2, concurrency))")
    parser.add_argument("--out", default="benchmarks/results/serving_cpu.json")
    parser.add_argument("--log-dir", default="/tmp/serving-grid-logs", help="server and bench_serving logs")
    parser.add_argument("--rerun", action="store_true",
                        help="measure rows again that the results file already holds (replacing them)")
    args = parser.parse_args()
    try:  # the same rule the server flags come from, checked before any model fetch or run
        long_context_args(max(args.input_lens) + args.output_len)
    except ValueError as err:
        parser.error(f"--input-lens plus --output-len: {err}")
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {"rows": []}
    data.update(date=str(date.today()), cpu=cpu_model_name(), model="SmolLM2-135M-Instruct, fp32")
    # the grid is run in pieces: every invocation that added rows is kept
    commands = data.setdefault("commands", [data.pop("command")] if "command" in data else [])
    commands.append(command_line())
    done = set() if args.rerun else {row_key(r) for r in data["rows"]}

    def save(row: dict) -> None:
        data["rows"] = [r for r in data["rows"] if row_key(r) != row_key(row)] + [row]
        out.write_text(json.dumps(data, indent=1))

    cells = [(w, n, c) for n in args.input_lens for c in args.concurrency for w in args.workloads]
    for name in args.configs:
        run_config(name, cells, ensure_model(), args.output_len, args.num_prompts, done, save, args.log_dir)


if __name__ == "__main__":
    main()
