"""``sglang.benchmark.one_batch`` (no server) for louver policies vs torch_native, fp32, on CPU.

One process per configuration (the grid's: ``torch_native``, louver ``budget-0.05``,
``certified-1e-3``), SmolLM2-135M in fp32 with the main command's YaRN override, batch size 1:
one_batch prefills each input length in a single extend (no chunking, no radix cache) and then
decodes ``--output-len`` tokens; a row records its prefill latency and median decode latency.

one_batch warms up with a full run at its first input length; the first length here is a short
one (``--warmup-len``, also measured and recorded) so that the long lengths are not prefilled
twice (a 32K prefill is ~20 minutes on this CPU). Rows are appended to ``one_batch_rows`` of
``--out`` and a rerun skips the rows already there.

    python -m benchmarks.serving.one_batch_cpu --input-lens 8192 16384 --out benchmarks/results/serving_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.serving.serving_grid_cpu import CONFIGS, DEFAULT_CONFIGS
from louver_eval.data.fetch_model import ensure_model
from louver_eval.server import long_context_args
from benchmarks.record import command_line

KEYS = {"prefill_latency": "prefill_s", "prefill_throughput": "prefill_tok_s",
        "median_decode_latency": "decode_median_s", "median_decode_throughput": "decode_tok_s",
        "total_latency": "total_s"}


def one_batch(model: Path, name: str, input_lens: list[int], output_len: int, log: Path) -> list[dict]:
    """Run one_batch for configuration ``name`` over ``input_lens`` (first = warm-up length)."""
    backend, policy, env = CONFIGS[name]
    longest = max(input_lens)
    cmd = [sys.executable, "-m", "benchmarks.serving.one_batch_plugins", "--model-path", str(model), "--device", "cpu",
           "--dtype", "float32", "--attention-backend", backend, "--batch-size", "1",
           "--input-len", *map(str, input_lens), "--output-len", str(output_len),
           "--max-total-tokens", str(longest + output_len + 1024), *long_context_args(longest + output_len)]
    with tempfile.TemporaryDirectory() as tmp:  # one_batch appends to its result file: a fresh one
        result_file = Path(tmp) / "one_batch.jsonl"
        cmd += ["--result-filename", str(result_file)]
        with log.open("w") as out:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=4 * 3600,
                                  env={**os.environ, **env})
        if proc.returncode != 0:
            raise RuntimeError(f"one_batch for {name} exited {proc.returncode}; see {log}")
        measured = [json.loads(line) for line in result_file.read_text().splitlines() if line.strip()]
    rows = []
    for result in measured:
        row = {"config": name, "backend": backend, "policy": policy, "input_len": result["input_len"],
               "batch_size": result["batch_size"], "output_len": result["output_len"],
               "warmup_input_len": input_lens[0]}
        row.update({ours: result.get(theirs) for theirs, ours in KEYS.items()})
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    parser.add_argument("--input-lens", nargs="+", type=int, default=[8192, 16384, 32640])
    parser.add_argument("--warmup-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--out", default="benchmarks/results/serving_cpu.json")
    parser.add_argument("--log-dir", default=None, help="keep one_batch's output here (default: a temp dir)")
    args = parser.parse_args()
    try:  # the same rule the server flags come from, checked before any model fetch or run
        long_context_args(max(args.input_lens) + args.output_len)
    except ValueError as err:
        parser.error(f"--input-lens plus --output-len: {err}")
    if args.warmup_len >= min(args.input_lens):
        parser.error("--warmup-len must be shorter than every --input-lens")
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {"rows": []}
    rows = data.setdefault("one_batch_rows", [])
    commands = data.setdefault("one_batch_commands", [])
    done = {(r["config"], r["input_len"]) for r in rows}
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="one_batch-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    model = ensure_model()
    for name in args.configs:
        todo = [n for n in args.input_lens if (name, n) not in done]
        if not todo:
            continue
        for row in one_batch(model, name, [args.warmup_len, *todo], args.output_len, log_dir / f"{name}.log"):
            if (name, row["input_len"]) in done:
                continue
            rows.append(row)
            done.add((name, row["input_len"]))
            print(json.dumps(row), flush=True)
        if commands[-1:] != [command := command_line()]:
            commands.append(command)
        out.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
