"""Needle-in-a-haystack through the SGLang server: dense (torch_native) vs louver policies.

A grid of context lengths x needle depths over the Paul Graham essays (single needle), plus
RULER-style multi-key and multi-value prompts, sent greedily to one ``sglang.launch_server`` per
configuration (CPU). Ground truth scores every answer; the dense server's answers are the
reference louver is compared with. One cache cell per (configuration, prompt); a server is only
started for a configuration with missing cells, so an interrupted run resumes where it stopped.
Prompts go longest first, needle deepest first, so the radix cache shares haystack prefixes.

    python -m benchmarks.quality.eval_niah --out benchmarks/results/eval_niah.json [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from louver_eval.data.fetch_model import DEFAULT_DIR as MODEL_DIR, ensure_model
from louver_eval.data.texts import load_text
from louver_eval.cache import add_run_arguments, cached_cell, command_line, machine_info, write_json
from louver_eval.niah import (NeedlePrompt, build_multikey_prompt, build_multivalue_prompt, build_prompt,
                                  found, found_all)
from louver_eval.server import LONG_PREFILL_ARGS, YARN_32K_ARGS, free_port, generate, sglang_server

DENSE = "torch_native"
CONFIGS = [DENSE, "certified-1e-3", "budget-0.1", "certified-1e-2", "budget-0.05", "certified-1e-4", "budget-0.2"]
# Three depths keep one configuration at about 13 minutes of CPU prefill here (five took 18)
FULL = {"lengths": [1024, 2048, 4096, 7680], "depths": [0.0, 0.5, 1.0], "multi_lengths": [2048, 4096],
        "configs": CONFIGS}
SMALL = {"lengths": [512], "depths": [0.5], "multi_lengths": [512], "configs": ["certified-1e-2"]}
# Past SmolLM2's 8K context, through the main command's YaRN override (one 16K torch_native
# prefill is over 5 minutes here, so one depth)
LONG = {"lengths": [16384], "depths": [0.5], "multi_lengths": [], "configs": [DENSE, "certified-1e-3", "budget-0.1"],
        "yarn": True}
MAX_NEW = {"single": 32, "multikey": 24, "multivalue": 40}  # the model restates the question first


def server_setup(config: str) -> tuple[str, dict[str, str]]:
    """(attention backend, LOUVER_* environment) of a configuration name."""
    if config == DENSE:
        return DENSE, {}
    kind, _, value = config.partition("-")
    if kind == "certified":
        return "louver", {"LOUVER_POLICY": "certified", "LOUVER_EPS": value}
    if kind == "budget":
        return "louver", {"LOUVER_POLICY": "budget", "LOUVER_BUDGET": value}
    raise ValueError(f"unknown configuration {config!r}: {DENSE}, certified-<eps> or budget-<f>")


def build_grid(tokenizer, grid: dict) -> dict[str, tuple[str, NeedlePrompt]]:
    """``{prompt id: (kind, prompt)}`` in the order to send them (radix-cache friendly)."""
    haystack = load_text("paul_graham")
    prompts = {}
    for n in sorted(grid["lengths"], reverse=True):
        for d in sorted(grid["depths"], reverse=True):
            prompts[f"single-{n}-{d:g}"] = ("single", build_prompt(tokenizer, haystack, n, d))
    for n in sorted(grid["multi_lengths"], reverse=True):
        prompts[f"multikey-{n}"] = ("multikey", build_multikey_prompt(tokenizer, haystack, n))
        prompts[f"multivalue-{n}"] = ("multivalue", build_multivalue_prompt(tokenizer, haystack, n))
    return prompts


def ask(url: str, kind: str, prompt: NeedlePrompt) -> dict:
    """One greedy request, scored against the ground truth."""
    start = time.perf_counter()
    # a 32K torch_native prefill is over 20 minutes on this CPU
    response = generate(url, prompt.text, max_new_tokens=MAX_NEW[kind], timeout=3 * 3600)
    text = response["text"]
    score = found_all(prompt.answer, text) if kind == "multivalue" else float(found(prompt.answer, text))
    return {"kind": kind, "length": prompt.tokens, "depth": prompt.depth, "answer": prompt.answer,
            "response": text, "score": score, "prompt_tokens": response["meta_info"]["prompt_tokens"],
            "seconds": round(time.perf_counter() - start, 1)}


def run_config(config: str, prompts: dict, model: Path, cache_dir: Path, dtype: str,
               yarn: bool = False) -> dict[str, dict]:
    """Cells of one configuration; starts a server (model and KV in ``dtype``; ``yarn``: its
    context stretched to 32K) only if some are missing."""
    paths = {pid: cache_dir / config / f"{pid}.json" for pid in prompts}
    if all(p.exists() for p in paths.values()):
        return {pid: cached_cell(p, dict) for pid, p in paths.items()}
    from tqdm import tqdm

    backend, env = server_setup(config)
    (cache_dir / config).mkdir(parents=True, exist_ok=True)
    # past 8K: the context stretched, and a watchdog above the longest dense extend chunk
    extra = ["--dtype", dtype, *(YARN_32K_ARGS + LONG_PREFILL_ARGS if yarn else [])]
    with sglang_server(model, backend, free_port(), env, extra=extra, timeout=900,
                       log_path=cache_dir / config / "server.log") as url:
        return {pid: cached_cell(paths[pid], lambda k=kind, p=prompt: ask(url, k, p))
                for pid, (kind, prompt) in tqdm(prompts.items(), desc=config)}


def cached_cells(config: str, prompts: dict, cache_dir: Path) -> dict[str, dict]:
    """The finished cells of a configuration that is not run now."""
    paths = {pid: cache_dir / config / f"{pid}.json" for pid in prompts}
    return {pid: json.loads(p.read_text()) for pid, p in paths.items() if p.exists()}


def compare(cells: dict[str, dict[str, dict]]) -> dict:
    """Per configuration: mean score per kind, and agreement with the dense server's answers."""
    dense = cells.get(DENSE, {})
    out = {}
    for config, rows in cells.items():
        kinds = {}
        for kind in dict.fromkeys(r["kind"] for r in rows.values()):
            scores = [r["score"] for r in rows.values() if r["kind"] == kind]
            kinds[kind] = {"prompts": len(scores), "mean_score": sum(scores) / len(scores)}
        shared = [pid for pid in rows if pid in dense]
        out[config] = {"kinds": kinds, "prompts": len(rows),
                       "same_score_as_dense": sum(rows[p]["score"] == dense[p]["score"] for p in shared),
                       "same_text_as_dense": sum(rows[p]["response"] == dense[p]["response"] for p in shared),
                       "compared_with_dense": len(shared)}
    return out




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, "niah", "CI size: one 512-token cell per kind, one louver server", threads=False)
    parser.add_argument("--model", type=Path, default=MODEL_DIR)
    parser.add_argument("--configs", nargs="+", default=None, help="run only these configurations")
    # SGLang's "auto" turns the fp32 checkpoint into fp16, whose matmuls have no fast CPU kernel in
    # torch (prefill ran at ~20 tokens/s here); fp32 is the checkpoint's own precision.
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="model and KV dtype of every server (cells are cached per dtype)")
    parser.add_argument("--long", action="store_true",
                        help="16K prompts through the YaRN-extended context (dense, certified 1e-3, budget 0.1)")
    parser.add_argument("--long-lengths", nargs="+", type=int, default=None,
                        help="with --long: these prompt lengths instead (at most 32000: the YaRN context is "
                             "32768 tokens, answer included)")
    args = parser.parse_args()
    args.cache = args.cache / args.dtype
    from transformers import AutoTokenizer

    grid = SMALL if args.small else LONG if args.long else FULL
    if args.long_lengths:
        if not args.long or max(args.long_lengths) > 32000:
            parser.error("--long-lengths needs --long and lengths of at most 32000 tokens")
        grid = {**LONG, "lengths": sorted(args.long_lengths)}
    unknown = sorted(set(args.configs or []) - set(grid["configs"]))
    if unknown:
        parser.error(f"unknown configurations {unknown}; choose from {grid['configs']}")
    model = ensure_model(args.model)
    prompts = build_grid(AutoTokenizer.from_pretrained(model), grid)
    cells = {}
    for config in grid["configs"]:
        if args.configs is None or config in args.configs:
            cells[config] = run_config(config, prompts, model, args.cache, args.dtype, grid.get("yarn", False))
        elif cached := cached_cells(config, prompts, args.cache):
            cells[config] = cached
    done = {c for c in grid["configs"] if all((args.cache / c / f"{p}.json").exists() for p in prompts)}
    module = f"eval_niah --dtype {args.dtype}" + (" --long" if args.long else "")
    if args.long_lengths:
        module += " --long-lengths " + " ".join(map(str, grid["lengths"]))
    result = {"command": command_line(module, args.small),
              "machine": machine_info(), "dtype": args.dtype, "grid": grid, "complete_configs": sorted(done),
              "missing_configs": [c for c in grid["configs"] if c not in done],
              "summary": compare(cells), "cells": cells}
    write_json(args.out, result)
    print(f"[niah] {sum(len(v) for v in cells.values())} cells -> {args.out}")


if __name__ == "__main__":
    main()
