"""How many tokens the server saw for the serving grid's rows whose prompts were sent as text.

``sglang.benchmark.serving`` without ``--tokenize-prompt`` draws a prompt of N token ids,
decodes it to text and sends the text; the server re-tokenizes it, and random ids do not
round-trip (a 32,640-id prompt came back as 34,214 tokens). This regenerates each such row's
prompts exactly as bench_serving did (its argument parser, ``--seed 1``, its dataset code and
the model's tokenizer), counts the tokens of each text as the server's tokenizer does, and
writes them into the row as ``server_prompt_tokens``. Rows sent as token ids are left alone.

    python -m benchmarks.serving.serving_prompt_tokens --results benchmarks/results/serving_cpu.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np

from benchmarks.serving.serving_grid_cpu import workload_args
from louver_eval.data.fetch_model import ensure_model


def bench_serving_args(argv: list[str]) -> argparse.Namespace:
    """bench_serving's own parsed arguments for ``argv`` (its run stopped before it starts)."""
    import sglang.benchmark.serving as bench

    captured = []
    run, saved_argv = bench.run_benchmark, sys.argv
    bench.run_benchmark = captured.append
    try:
        sys.argv = ["sglang.benchmark.serving", *argv]
        bench.cli_main()
    finally:
        bench.run_benchmark, sys.argv = run, saved_argv
    return captured[0]


def server_tokens(model: Path, row: dict) -> list[int]:
    """Token counts of the prompts of ``row`` as the server's tokenizer sees their text."""
    from sglang.benchmark.datasets import get_dataset
    from sglang.benchmark.utils import get_tokenizer

    argv = ["--backend", "sglang", "--tokenizer", str(model), "--model", str(model), "--seed", "1",
            *workload_args(row["workload"], row["input_len"], row["concurrency"], row["output_len"],
                           row["num_prompts"])]
    args = bench_serving_args(argv)
    tokenizer = get_tokenizer(str(model))
    random.seed(args.seed)  # as bench_serving seeds before it draws the dataset
    np.random.seed(args.seed)
    prompts = [r.prompt for r in get_dataset(args, tokenizer, str(model))]
    return [len(tokenizer.encode(p)) for p in prompts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="benchmarks/results/serving_cpu.json")
    args = parser.parse_args()
    path = Path(args.results)
    data = json.loads(path.read_text())
    model = ensure_model()
    for row in data["rows"]:
        if row.get("prompt_as_token_ids"):
            continue
        row["prompt_as_token_ids"] = False
        row["server_prompt_tokens"] = server_tokens(model, row)
        print(row["config"], row["workload"], row["input_len"], row["server_prompt_tokens"], flush=True)
    path.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
