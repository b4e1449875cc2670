"""Cost of summing one decode forward's telemetry: the pending steps one by one vs concatenated.

With ``LOUVER_STATS_FILE`` set the backend sums every decode forward's recorded steps (one
``StepStats`` per layer) before it writes the file. This times that sum for ``--layers`` steps of
batch ``--batch`` both ways, interleaved, in one process.

    python -m benchmarks.serving.telemetry_sum_cpu --layers 30 --batch 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from louver_sgl.decode.contract import StepStats
from louver_sgl.serving.telemetry import Counts, Telemetry


def steps(layers: int, batch: int, heads: int) -> list[StepStats]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(layers):
        packed = torch.rand(batch, heads + 1, 5, generator=gen, dtype=torch.float64).mul(100).floor()
        packed[:, heads, 0] = 0.0
        packed[..., 4] = (packed[..., 4] > 95).double()  # a few lowered heads
        num_indexed = torch.full((batch,), 8000)
        out.append(StepStats.from_packed(packed, num_indexed, num_indexed // 128))
    return out


def one_by_one(pending: list[StepStats]) -> None:
    counts = Counts()
    for s in pending:
        counts.add(s)


def concatenated(pending: list[StepStats]) -> None:
    tel = Telemetry(interval=0)
    tel.pending = list(pending)
    tel._sum_pending()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    times = {"one_by_one": [], "concatenated": []}
    for _ in range(args.repeats):
        for name, fn in (("one_by_one", one_by_one), ("concatenated", concatenated)):
            pending = steps(args.layers, args.batch, args.heads)  # fresh: unpacked fields are cached
            start = time.perf_counter()
            fn(pending)
            times[name].append(time.perf_counter() - start)
    print(json.dumps({k: round(1e3 * statistics.median(v), 3) for k, v in times.items()} | vars(args)))


if __name__ == "__main__":
    main()
