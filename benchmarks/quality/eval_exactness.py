"""Exactness at scale on SmolLM2 generations: recall vs fp64 and the certified dropped-mass bound.

Each prompt is a window of a long text (Paul Graham essays or the Bible); SmolLM2-135M generates
greedily from it with the louver step (torch path, ``eval.attended``) in every layer's every decode
step, and every (layer, query head, step) is checked against an fp64 brute force
(``eval.exactness``). One cache cell per prompt (JSON summary + NPZ of per-query-step bound and
measured mass); a rerun skips finished prompts. Writes the aggregate to ``--out``.

    python -m benchmarks.quality.eval_exactness --out benchmarks/results/eval_exactness.json
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from louver_eval.data.fetch_model import DEFAULT_DIR as MODEL_DIR
from louver_eval.data.texts import load_text
from louver_eval.cache import add_run_arguments, cached_cell, command_line, machine_info, write_json
from louver_eval.exactness import ExactnessObserver
from louver_eval.hf_decode import DecodeRunner, greedy_generate, load_eval_model
from louver_eval.policies import make_policy, text_window_ids


@dataclass(frozen=True)
class PromptSpec:
    """A generation: ``length`` prompt tokens of ``text`` from character ``offset``, ``policy``."""

    text: str
    offset: int
    length: int
    policy: str
    new_tokens: int

    @property
    def name(self) -> str:
        return f"{self.text}-{self.offset}-{self.length}-{self.policy}-{self.new_tokens}"


def full_prompts(new_tokens: int = 470) -> list[PromptSpec]:
    """8 prompts x 470 tokens x 270 query heads = 1,015,200 query-steps."""
    plan = [(1024, "certified-1e-3"), (2048, "certified-1e-2"), (3072, "budget-0.1"), (4096, "certified-1e-3")]
    return [PromptSpec(text, 50_000 * (i + 1), n, policy, new_tokens)
            for text in ("paul_graham", "bible") for i, (n, policy) in enumerate(plan)]


def small_prompts() -> list[PromptSpec]:
    """The CI size: two short prompts, a few tokens each."""
    return [PromptSpec("paul_graham", 0, 300, "certified-1e-3", 4), PromptSpec("bible", 0, 300, "budget-0.1", 4)]


def run_prompt(spec: PromptSpec, model, tokenizer, runner: DecodeRunner, cache_dir: Path) -> dict:
    """Generate for one prompt under the observer; cache the summary and the per-step arrays."""
    observer = ExactnessObserver()
    runner.policy, runner.observer = make_policy(spec.policy), observer
    ids = text_window_ids(tokenizer, load_text(spec.text), spec.offset, spec.length)
    start = time.perf_counter()
    from tqdm import tqdm

    with tqdm(total=spec.new_tokens, desc=spec.name, unit="token", leave=False) as bar:
        tokens = greedy_generate(model, ids, runner, spec.new_tokens, on_token=lambda _: bar.update())
    np.savez_compressed(cache_dir / f"{spec.name}.npz", **observer.arrays())
    return {"prompt": spec.__dict__, "layers": observer.summary(), "seconds": round(time.perf_counter() - start, 1),
            "generated": tokenizer.decode(tokens)[:200]}


def aggregate(cells: list[dict], arrays: list[dict[str, np.ndarray]]) -> dict:
    """Totals over every prompt, per layer and per policy, plus the bound/measured distribution."""
    per_layer: dict[str, dict] = {}
    per_policy: dict[str, dict] = {}
    policy_layer: dict[str, dict[str, dict]] = {}
    total: dict = {}
    for cell in cells:
        policy = cell["prompt"]["policy"]
        for layer, t in cell["layers"].items():
            for acc in (per_layer.setdefault(layer, {}), per_policy.setdefault(policy, {}), total,
                        policy_layer.setdefault(policy, {}).setdefault(layer, {})):
                _add(acc, t)
    return {"total": _finish(total), "per_layer": {k: _finish(v) for k, v in per_layer.items()},
            "per_policy": {k: _finish(v) for k, v in per_policy.items()},
            "per_policy_layer": {p: {k: _finish(v) for k, v in rows.items()} for p, rows in policy_layer.items()},
            "mass": mass_distribution(cells, arrays)}


def _add(acc: dict, t: dict) -> None:
    n = t["query_steps"]
    for key in ("query_steps", "steps", "keys_at_or_above_T", "missed", "dense_fallback_steps", "bound_violations"):
        acc[key] = acc.get(key, 0) + t[key]
    for key in ("candidate_fraction", "page_survival"):
        acc[key + "_sum"] = acc.get(key + "_sum", 0.0) + t[key] * n


def _finish(acc: dict) -> dict:
    n = max(acc["query_steps"], 1)
    out = {k: v for k, v in acc.items() if not k.endswith("_sum")}
    out["recall"] = 1.0 if acc["keys_at_or_above_T"] == 0 else 1.0 - acc["missed"] / acc["keys_at_or_above_T"]
    out["candidate_fraction"] = acc["candidate_fraction_sum"] / n
    out["page_survival"] = acc["page_survival_sum"] / n
    return out


def mass_distribution(cells: list[dict], arrays: list[dict[str, np.ndarray]]) -> dict:
    """Per policy: quantiles of the bound, the measured mass and their ratio (sparse steps only)."""
    out = {}
    for policy in sorted({c["prompt"]["policy"] for c in cells}):
        rows = [a for c, a in zip(cells, arrays) if c["prompt"]["policy"] == policy]
        bound = np.concatenate([a["bound"] for a in rows])
        measured = np.concatenate([a["measured"] for a in rows])
        sparse = bound > 0  # a dense fallback drops nothing: bound = measured = 0
        qs = [0.0, 0.5, 0.9, 0.99, 1.0]
        ratio = measured[sparse] / bound[sparse]
        out[policy] = {
            "query_steps": int(len(bound)), "sparse_query_steps": int(sparse.sum()),
            "measured_le_bound": int((measured <= bound).sum()),
            "quantiles": qs,
            "bound": _quantiles(bound[sparse], qs), "measured": _quantiles(measured[sparse], qs),
            "measured_over_bound": _quantiles(ratio, qs),
        }
    return out


def _quantiles(x: np.ndarray, qs: list[float]) -> list[float]:
    return [float(v) for v in np.quantile(x, qs)] if len(x) else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, "exactness", "CI size: two short prompts")
    parser.add_argument("--model", type=Path, default=MODEL_DIR)
    parser.add_argument("--max-prompts", type=int, default=None, help="stop after this many new prompts")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from tqdm import tqdm

    prompts = small_prompts() if args.small else full_prompts()
    args.cache.mkdir(parents=True, exist_ok=True)
    runner = DecodeRunner(make_policy(prompts[0].policy))
    model, tokenizer = load_eval_model(args.model, runner)
    cells, fresh = [], 0
    for spec in tqdm(prompts, desc="exactness prompts"):
        path = args.cache / f"{spec.name}.json"
        if not path.exists() and args.max_prompts is not None and fresh >= args.max_prompts:
            continue
        fresh += not path.exists()
        cells.append(cached_cell(path, lambda s=spec: run_prompt(s, model, tokenizer, runner, args.cache)))
    arrays = [dict(np.load(args.cache / f"{PromptSpec(**c['prompt']).name}.npz")) for c in cells]
    result = {"command": command_line("eval_exactness", args.small),
              "machine": machine_info(), "complete": len(cells) == len(prompts),
              "prompts": [c["prompt"] for c in cells], "seconds": sum(c["seconds"] for c in cells),
              **aggregate(cells, arrays)}
    write_json(args.out, result)
    total = result["total"]
    print(f"[exactness] {total['query_steps']:,} query-steps, recall {total['recall']}, missed {total['missed']}, "
          f"bound violations {total['bound_violations']} -> {args.out}")


if __name__ == "__main__":
    main()
