"""Per-token KL of louver's (and the baselines') next-token distribution from dense, held-out essays.

In-process with the HF model (``eval.kl``): SGLang's server returns top logprobs only, not full
distributions, so the KL is computed offline with the same louver step on the model's real q/k/v.
Windows come from the second half of the Paul Graham essays (the needle-in-a-haystack prompts
use the first 8K tokens). One cache cell per (window, policy).

    python -m benchmarks.quality.eval_kl --out benchmarks/results/eval_kl.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import numpy as np

from louver_eval.data.fetch_model import DEFAULT_DIR as MODEL_DIR
from louver_eval.data.texts import load_text
from louver_eval.cache import add_run_arguments, cached_cell, command_line, machine_info, write_json
from louver_eval.hf_decode import DecodeRunner, load_eval_model, prefill
from louver_eval.kl import AttendedFraction, dense_logits, kl_summary, policy_logits
from louver_eval.policies import make_policy, text_window_ids

POLICIES = ["certified-1e-2", "certified-1e-3", "certified-1e-4", "budget-0.05", "budget-0.1", "budget-0.2",
            "oracle_topk-0.1", "quest-0.1", "streaming-0.1"]
FULL = {"offsets": [330_000, 450_000, 570_000], "context": 2048, "tokens": 32, "policies": POLICIES}
SMALL = {"offsets": [330_000], "context": 300, "tokens": 4, "policies": ["certified-1e-2", "budget-0.1", "quest-0.1"]}


def run_window(model, tokenizer, runner: DecodeRunner, offset: int, grid: dict, cache_dir: Path) -> list[dict]:
    """All policies on one window; the dense prefill and dense logits are shared."""
    ids = text_window_ids(tokenizer, load_text("paul_graham"), offset, grid["context"] + grid["tokens"])
    context, cont = ids[: grid["context"]], ids[grid["context"]:]
    cache, _ = prefill(model, context, runner)
    reference = dense_logits(model, cache, cont, runner)
    rows = []
    for name in grid["policies"]:
        def compute(name=name):
            runner.policy, runner.observer = make_policy(name), AttendedFraction()
            logits = policy_logits(model, cache, cont, runner, len(ids))
            return {"offset": offset, "context": grid["context"], "policy": name,
                    "attended_fraction": runner.observer.mean, **kl_summary(reference, logits)}

        rows.append(cached_cell(cache_dir / f"{offset}_{grid['context']}_{grid['tokens']}_{name}.json", compute))
    return rows


def summarise(rows: list[dict]) -> dict:
    """Per policy over every window: mean, median, p90 and max per-token KL, top-1 agreement."""
    out = {}
    for name in dict.fromkeys(r["policy"] for r in rows):
        kl = np.concatenate([r["kl"] for r in rows if r["policy"] == name])
        agree = np.mean([r["top1_agreement"] for r in rows if r["policy"] == name])
        attended = np.mean([r["attended_fraction"] for r in rows if r["policy"] == name])
        out[name] = {"tokens": int(len(kl)), "mean_kl": float(kl.mean()), "median_kl": float(np.median(kl)),
                     "p90_kl": float(np.quantile(kl, 0.9)), "max_kl": float(kl.max()), "top1_agreement": float(agree),
                     "attended_fraction": float(attended)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, "kl", "CI size: one short window, three policies")
    parser.add_argument("--model", type=Path, default=MODEL_DIR)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from tqdm import tqdm

    grid = SMALL if args.small else FULL
    runner = DecodeRunner(make_policy(grid["policies"][0]))
    model, tokenizer = load_eval_model(args.model, runner)
    rows = []
    for offset in tqdm(grid["offsets"], desc="kl windows"):
        rows += run_window(model, tokenizer, runner, offset, grid, args.cache)
    result = {"command": command_line("eval_kl", args.small),
              "machine": machine_info(), "grid": grid, "policies": summarise(rows), "rows": rows}
    write_json(args.out, result)
    print(f"[kl] {len(rows)} (window, policy) cells -> {args.out}")


if __name__ == "__main__":
    main()
