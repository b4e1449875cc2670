"""Serving TTFT/TPOT of this checkout against another revision's louver package, paired on CPU.

For a change to the serving hot path (the CPU decode path, the backend): the "before" arm's
server imports a worktree of the revision before it (``git worktree add /work/before REV``):
its packages are linked into a directory put first on PYTHONPATH, whose ``sitecustomize`` drops
the editable install's import finder (which would otherwise win over PYTHONPATH). SGLang and the
environment are the same in both arms. Runs alternate before/after; ``LOUVER_PROFILE=none`` gives
both arms the same built-in options (profiles may differ between revisions) and both run with
``--sleep-on-idle`` (the later revision turns it on by itself). Workload:
``sglang.benchmark.serving`` random-token prompts at concurrency 1.

    python -m benchmarks.studies.paired_revision_serving --before-src /work/before \\
        --out benchmarks/results/paired_revision_serving.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from pathlib import Path

from louver_eval.data.fetch_model import ensure_model
from louver_eval.server import free_port, sglang_server
from louver_kernels.cpu_ops import cpu_model_name

from benchmarks.record import write_result
from benchmarks.serving.idle_cpu import YARN
from benchmarks.serving.serving_cpu import bench_serving


def revision(src: Path) -> str:
    return subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()


SITECUSTOMIZE = """import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__
                    and "editable" not in getattr(f, "__name__", "")]
"""


def before_path(src: Path, logs: Path) -> Path:
    """A PYTHONPATH directory that imports ``src``'s packages instead of the editable install's."""
    root = logs / "before-path"
    root.mkdir(parents=True, exist_ok=True)
    for name, target in (("louver_sgl", "louver_sgl"), ("louver_kernels", "kernels"), ("louver_eval", "eval")):
        link = root / name
        if link.is_symlink():
            link.unlink()
        link.symlink_to(src.resolve() / target)
    (root / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return root


def run_once(model: Path, arm: str, src: Path | None, args: argparse.Namespace, logs: Path, index: int) -> dict:
    env = {"LOUVER_PROFILE": "none", "LOUVER_STATS_FILE": str(logs / f"stats-{arm}-{index}.json")}
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(before_path(src, logs)), os.environ.get("PYTHONPATH")) if p)
    extra = ["--dtype", "float32", "--json-model-override-args", YARN, "--sleep-on-idle"]
    with sglang_server(model, "louver", free_port(), env, extra, log_path=logs / f"server-{arm}-{index}.log",
                       max_total_tokens=65536) as url:
        workload = ["--dataset-name", "random-ids", "--random-input-len", str(args.input_len), "--random-output-len",
                    str(args.output_len), "--random-range-ratio", "1.0", "--num-prompts", str(args.prompts),
                    "--max-concurrency", "1"]
        bench = bench_serving(url, model, workload, logs / f"bench-{arm}-{index}.jsonl")
    return {"arm": arm, "run": index, **bench}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before-src", required=True, type=Path, help="a worktree of the revision before")
    parser.add_argument("--out", default="benchmarks/results/paired_revision_serving.json")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=4096)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--log-dir", default="/tmp/paired-revision-logs")
    args = parser.parse_args()
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    model = ensure_model()
    runs = []
    for index in range(args.pairs):
        for arm, src in (("before", args.before_src), ("after", None)):
            runs.append(run_once(model, arm, src, args, logs, index))
            print(json.dumps(runs[-1]), flush=True)
    mean = {arm: {k: statistics.mean(r[k] for r in runs if r["arm"] == arm) for k in ("mean_ttft_ms", "mean_tpot_ms")}
            for arm in ("before", "after")}
    ratios = {k: mean["after"][k] / mean["before"][k] for k in ("mean_ttft_ms", "mean_tpot_ms")}
    write_result(args.out, {"machine": {"cpu": cpu_model_name(), "cores": os.cpu_count()},
                            "revisions": {"before": revision(args.before_src), "after": revision(Path("."))},
                            "settings": {k: str(v) for k, v in vars(args).items() if k != "out"},
                            "mean": mean, "after_over_before": ratios, "runs": runs})
    print(json.dumps({"mean": mean, "after_over_before": ratios}, indent=1))


if __name__ == "__main__":
    main()
