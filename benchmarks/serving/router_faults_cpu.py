"""A louver worker killed under load behind sglang-router, and restarted (``louver_eval.router_faults``).

The main command's model (SmolLM2 fp32, YaRN 32K) on two workers, one core each; prompts are
``--groups`` documents of ``--prefix-tokens`` tokens of Paul Graham's essays, each with
``--per-group`` questions. Writes every request's outcome and a per-phase summary.

    python -m benchmarks.serving.router_faults_cpu --out benchmarks/results/router_faults_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from louver_eval.data.fetch_model import ensure_model
from louver_eval.data.texts import load_text
from louver_eval.router_faults import FaultPlan, fault_run, summary
from louver_eval.server import LONG_PREFILL_ARGS, YARN_32K_ARGS, stop_servers_on_sigterm
from louver_kernels.cpu_ops import cpu_model_name

from benchmarks.record import write_result

QUESTIONS = ("What is the main point of this text?", "Name one person the text mentions.",
             "What does the author recommend?", "Summarise the first paragraph.")


def prompts(model: Path, groups: int, per_group: int, prefix_tokens: int) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    ids = tokenizer(load_text("paul_graham"))["input_ids"]
    docs = [tokenizer.decode(ids[g * prefix_tokens:(g + 1) * prefix_tokens]) for g in range(groups)]
    return [f"{doc}\n\nQuestion: {QUESTIONS[q % len(QUESTIONS)]}\nAnswer:" for doc in docs for q in range(per_group)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/router_faults_cpu.json")
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--per-group", type=int, default=3)
    parser.add_argument("--fresh-groups", type=int, default=2, help="groups only the phase after the restart sends")
    parser.add_argument("--policy", default="cache_aware", choices=["cache_aware", "round_robin"])
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--before", type=float, default=90.0)
    parser.add_argument("--during", type=float, default=45.0)
    parser.add_argument("--after", type=float, default=120.0)
    parser.add_argument("--log-dir", default="/tmp/router-faults-logs")
    a = parser.parse_args()
    stop_servers_on_sigterm()
    model = ensure_model()
    plan = FaultPlan(a.clients, a.before, a.during, a.after)
    every = prompts(model, a.groups + a.fresh_groups, a.per_group, a.prefix_tokens)
    known = a.groups * a.per_group
    run = fault_run(model, every[:known], Path(a.log_dir), plan, fresh=every[known:], policy=a.policy,
                    worker_extra=["--dtype", "float32", *YARN_32K_ARGS, *LONG_PREFILL_ARGS])
    phases = summary(run)
    write_result(a.out, {"machine": {"cpu": cpu_model_name(), "cores": os.cpu_count()},
                         "settings": {k: v for k, v in vars(a).items() if k != "out"}, "phases": phases,
                         **{k: v for k, v in run.items() if k != "outcomes"}, "outcomes": run["outcomes"]})
    print(json.dumps(phases, indent=1))
    print(json.dumps({k: v for k, v in run.items() if k != "outcomes"}, indent=1))


if __name__ == "__main__":
    main()
