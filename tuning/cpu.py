"""The CPU target: the compiled CPU kernel (grid family) or the vectorised torch step, timed by wall clock."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Mapping

import torch
from optuna.distributions import BaseDistribution, CategoricalDistribution

from louver_sgl import LouverConfig, PageIndexStore
from louver_eval.data.paged import PagedBatch
from louver_sgl.decode import LouverDecode
from louver_sgl.profiles.launch import cpu_threads

from .target import StepFn, Target, TimedPoint

CHUNK_PAGES = (8, 16, 32, 64, 128, 256)


class WallClockTimer:
    """Median wall time over ``repeats`` runs after ``warmup`` runs, in milliseconds."""

    def __init__(self, repeats: int = 5, warmup: int = 1) -> None:
        if repeats < 1 or warmup < 0:
            raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
        self.repeats, self.warmup = repeats, warmup

    def __call__(self, step: StepFn, point: TimedPoint) -> float:
        for _ in range(self.warmup):
            step()
        times = []
        for _ in range(self.repeats):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)


class CpuTarget(Target):
    """Launch parameters: ``chunk_pages`` (the largest task of the compiled kernel, in pages; the
    host shrinks tasks towards the end of the batch), ``num_threads`` (torch threads around the
    step, 1..cores), ``one_scan`` (certified steps read the codes once) and ``residual_weights``
    (token bounds as tight as fp32 ones for a second integer dot: fewer keys against more
    arithmetic, which wins depends on the CPU and the policy). Steps are timed with the batch
    planned once, as the server plans once per forward pass."""

    name = "cpu"

    def __init__(self, repeats: int = 5, warmup: int = 1) -> None:
        self._timer = WallClockTimer(repeats, warmup)

    def launch_space(self) -> dict[str, BaseDistribution]:
        threads = list(range(1, (os.cpu_count() or 1) + 1))
        return {"chunk_pages": CategoricalDistribution(CHUNK_PAGES),
                "num_threads": CategoricalDistribution(threads),
                "one_scan": CategoricalDistribution([True, False]),
                "residual_weights": CategoricalDistribution([False, True])}

    def default_launch(self) -> dict[str, Any]:
        return {"chunk_pages": 64, "num_threads": torch.get_num_threads(), "one_scan": True,
                "residual_weights": False}

    def timer(self) -> WallClockTimer:
        return self._timer

    def place(self, batch: PagedBatch) -> PagedBatch:
        return batch

    def make_step(self, batch: PagedBatch, store: PageIndexStore, config: LouverConfig,
                  launch: Mapping[str, Any]) -> StepFn:
        kernel = {"chunk_pages": int(launch["chunk_pages"]), "one_scan": bool(launch.get("one_scan", True)),
                  "residual_weights": bool(launch.get("residual_weights", False))}
        decode = LouverDecode(config, "cpu", launch=kernel)
        with cpu_threads(int(launch["num_threads"])):  # the plan side is made for this thread count
            decode.plan(batch.page_table, batch.seq_lens)

        def step():
            with cpu_threads(int(launch["num_threads"])):
                step_result = decode.run(batch.q, batch.k, batch.v, store, batch.sigma, stats=True)
                return step_result.out, step_result.stats
        return step
