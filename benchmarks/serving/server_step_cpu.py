"""The louver decode step inside the CPU server, timed per layer, against the same step standalone.

Starts ``python -m sglang.launch_server`` with louver (``LOUVER_STEP_TIMING=1``: the backend
times each decode step and its own work around it into the statistics file), sends one greedy
request of ``--tokens`` prompt tokens and ``--new-tokens`` output tokens, and reports the step's
mean time per layer and the backend's own time per layer in the server, with the request's
TPOT. Each ``--variant`` is a set of extra server arguments and ``LOUVER_*=value`` variables (e.g.
``--disable-overlap-schedule`` or ``LOUVER_CHUNK_PAGES=8``). Past SmolLM2's 8K context the
server runs with the main command's YaRN override (``scripts/run.sh``).
Compare with ``python -m benchmarks.cpu.decode_cpu --kv-dtype float32 --indexes grid-4bit-p128
--traces data/traces/bible_8192.pt --batches 1`` (the same index and policy at the same context).

    python -m benchmarks.serving.server_step_cpu --tokens 8000 --out benchmarks/results/server_step_cpu.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import urllib.request
from datetime import date
from pathlib import Path

from louver_kernels.cpu_ops import cpu_model_name
from louver_eval.data.fetch_model import ensure_model
from louver_eval.data.texts import load_text
from louver_eval.server import free_port, long_context_args, sglang_server

ENV = {"LOUVER_PROFILE": "none", "LOUVER_GRID_BITS": "4", "LOUVER_PAGE_SIZE": "128", "LOUVER_POLICY": "budget",
       "LOUVER_BUDGET": "0.05", "LOUVER_MIN_SPARSE_TOKENS": "0", "LOUVER_STEP_TIMING": "1"}
# --defaults: the backend's own defaults and this machine's shipped profile, as the main command serves
DEFAULTS_ENV = {"LOUVER_STEP_TIMING": "1"}
ARGS = ["--dtype", "float32", "--max-total-tokens", "40000"]


def server_args(prompt_tokens: int, new_tokens: int) -> list[str]:
    return ARGS + long_context_args(prompt_tokens + new_tokens)


def streamed(url: str, ids: list[int], new_tokens: int) -> tuple[float, float]:
    """(TTFT s, TPOT s) of one greedy streamed request over token ids."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start, stamps = time.time(), []
    with urllib.request.urlopen(req, timeout=3600) as resp:
        for raw in resp:
            if raw.strip().startswith(b"data:") and raw.strip() != b"data: [DONE]":
                stamps.append(time.time())
    ttft = stamps[0] - start
    return ttft, (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1)


def run_variant(ids: list[int], new_tokens: int, variant: list[str], base_env: dict = ENV) -> dict:
    """One server run; ``variant``: extra server args, and LOUVER_*=value words as its environment
    over ``base_env``."""
    variant_env = dict(w.split("=", 1) for w in variant if w.startswith("LOUVER_") and "=" in w)
    extra = [w for w in variant if not (w.startswith("LOUVER_") and "=" in w)]
    with tempfile.TemporaryDirectory() as tmp:
        stats = Path(tmp) / "stats.json"
        env = {**base_env, **variant_env, "LOUVER_STATS_FILE": str(stats)}
        args = server_args(len(ids), new_tokens) + extra
        with sglang_server(ensure_model(), "louver", free_port(), env, args, timeout=600,
                           log_path=Path(tmp) / "server.log") as url:
            ttft, tpot = streamed(url, ids, new_tokens)
            time.sleep(1.0)
            s = json.loads(stats.read_text())
    steps = max(s["timed_steps"], 1)
    return {"extra_args": extra, "extra_env": variant_env, "ttft_s": ttft, "tpot_ms": 1e3 * tpot, "timed_steps": s["timed_steps"],
            "step_ms_per_layer": 1e3 * s["step_seconds"] / steps,
            "backend_ms_per_layer": 1e3 * s["backend_seconds"] / steps, "sparse_steps": s["sparse_steps"],
            "attended_fraction": s.get("attended_fraction")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--variant", action="append", default=None,
                        help="extra server args and LOUVER_*=value variables of one run, space separated "
                             "(repeatable; default: '' and '--disable-overlap-schedule')")
    parser.add_argument("--defaults", action="store_true",
                        help="serve with the backend's defaults and this machine's profile (as the main command "
                             "does) instead of the 4-bit budget setting above")
    parser.add_argument("--out", default="benchmarks/results/server_step_cpu.json")
    args = parser.parse_args()
    base_env = DEFAULTS_ENV if args.defaults else ENV
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_model()))
    ids = tokenizer(load_text("bible"), add_special_tokens=False)["input_ids"][: args.tokens]
    variants = args.variant if args.variant is not None else ["", "--disable-overlap-schedule"]
    rows = []
    for v in variants:
        rows.append(run_variant(ids, args.new_tokens, v.split(), base_env))
        print(json.dumps(rows[-1]), flush=True)
    Path(args.out).write_text(json.dumps({
        "date": str(date.today()), "cpu": cpu_model_name(), "server_env": base_env, "server_args": server_args(len(ids), args.new_tokens),
        "prompt_tokens": len(ids), "new_tokens": args.new_tokens, "rows": rows,
        "command": f"python -m benchmarks.serving.server_step_cpu --tokens {args.tokens} --new-tokens {args.new_tokens} "
                   + " ".join(f"--variant '{v}'" for v in variants) + (" --defaults" if args.defaults else "")
                   + f" --out {args.out}"}, indent=1))


if __name__ == "__main__":
    main()
