"""Index build cost of a long prefill on CPU, against the request's time to first token.

Builds the page index of ``--tokens`` tokens of keys (SmolLM2 shapes: 3 KV heads, D = 64, fp32
pool) for every layer the way the server's extend does (``ServingIndex.build``: the pages a
chunk completed, one call per layer and chunk) and reports the build time per layer and for all
layers next to a measured TTFT (default: the 30K-token server run of
``benchmarks/results/server_step_cpu_30k.json``).

    python -m benchmarks.cpu.prefill_build_cpu --tokens 30000 --out benchmarks/results/prefill_build_cpu.json
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import date
from pathlib import Path

import torch

from louver_kernels.cpu_ops import cpu_model_name
from louver_sgl.config import LouverConfig
from louver_sgl.index.store import PageIndexStore
from louver_sgl.profiles import SHIPPED_DIR, Profile
from benchmarks.record import command_line

# The index options the CPU server runs with in fp32 (the serving benchmarks' KV dtype).
SERVED_PROFILE = SHIPPED_DIR / "cpu_amd_epyc_avx2.float32.json"


def build_seconds(config: LouverConfig, tokens: int, chunk: int, layers: int, kv_heads: int, dim: int) -> float:
    """Seconds to build ``layers`` layers' index of ``tokens`` keys, chunk by chunk."""
    size = config.page_size
    pages = tokens // size
    k = torch.randn(pages * size, kv_heads, dim, generator=torch.Generator().manual_seed(0))
    stores = [PageIndexStore(config, pages, kv_heads, dim, torch.float32) for _ in range(layers)]
    start = time.perf_counter()
    for first in range(0, tokens, chunk):
        done = torch.arange(first // size, min(first + chunk, tokens) // size)
        for store in stores:
            store.build_pages(k, done)
    return time.perf_counter() - start


def main() -> None:
    served = Profile.load(SERVED_PROFILE).config
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=30000)
    parser.add_argument("--chunk", type=int, default=4096, help="SGLang's chunked prefill size")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--page-size", type=int, default=served["page_size"], help=f"default: {SERVED_PROFILE.name}'s")
    parser.add_argument("--grid-bits", type=int, default=served["grid_bits"], help=f"default: {SERVED_PROFILE.name}'s")
    parser.add_argument("--ttft-from", default="benchmarks/results/server_step_cpu_30k.json")
    parser.add_argument("--out", default="benchmarks/results/prefill_build_cpu.json")
    args = parser.parse_args()
    config = LouverConfig(page_size=args.page_size, grid_bits=args.grid_bits)
    build_seconds(config, 4 * args.page_size, args.chunk, 1, 3, 64)  # warm-up
    seconds = min(build_seconds(config, args.tokens, args.chunk, args.layers, 3, 64) for _ in range(3))
    ttft = json.loads(Path(args.ttft_from).read_text())["rows"][0]["ttft_s"]
    result = {"date": str(date.today()), "cpu": cpu_model_name(), "tokens": args.tokens, "layers": args.layers,
              "page_size": args.page_size, "grid_bits": args.grid_bits, "build_s": seconds,
              "build_ms_per_layer": 1e3 * seconds / args.layers, "ttft_s": ttft, "ttft_from": args.ttft_from,
              "build_fraction_of_ttft": seconds / ttft,
              "command": command_line()}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
