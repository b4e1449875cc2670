"""The CUDA target: the Triton decode step, timed by CUDA events over CUDA-graph replays."""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any, Mapping

import torch
from optuna.distributions import BaseDistribution, CategoricalDistribution

from louver_kernels.triton.launch import TritonLaunch
from louver_kernels.triton.timing import graph_replay_ms
from louver_sgl import LouverConfig, PageIndexStore
from louver_eval.data.paged import PagedBatch
from louver_sgl.decode import HeadShapes, LouverDecode

from .target import StepFn, Target, TimedPoint

# Launch parameters searched (the rest keep their defaults); names are ``TritonLaunch`` fields,
# except ``cuda_decode`` (a ``ServingOptions`` field: the implementation the step runs).
LAUNCH_CHOICES = {
    "cuda_decode": ("triton", "triton_stream", "triton_tiled"),  # a serving option: which Triton implementation
    "pages_per_split": (4, 8, 16, 32, 64),
    "attend_warps": (2, 4, 8),
    "attend_stages": (1, 2, 3),
    "hist_warps": (2, 4, 8),
    "exact_warps": (2, 4, 8),
    "merge_block": (8, 16, 32),
    "filter_warps": (2, 4, 8),
    "filter_stages": (1, 2, 3),
    "survivor_block": (32, 64, 128),
    "survivor_warps": (2, 4, 8),
    "tile_pages": (1, 2, 4, 8),
    "tile_warps": (2, 4, 8),
    "tile_atomic": (0, 1),
    "window_edges": (16, 32, 64),
    "list_block": (32, 64, 128),
    "list_warps": (2, 4, 8),
    "list_splits": (16, 32, 64),
    "list_min_rows": (128, 256, 512),
}


class CudaEventTimer:
    """Median CUDA-event time (ms) of ``repeats`` replays of a CUDA graph of the step, captured
    after ``warmup`` eager runs (compilation and autotuning stay out of the numbers)."""

    def __init__(self, repeats: int = 20, warmup: int = 3) -> None:
        if repeats < 1 or warmup < 1:
            raise ValueError(f"repeats and warmup must be >= 1, got {repeats}, {warmup}")
        self.repeats, self.warmup = repeats, warmup

    def __call__(self, step: StepFn, point: TimedPoint) -> float:
        return graph_replay_ms(step, self.repeats, self.warmup)


class CudaTarget(Target):
    """Launch parameters: the ``TritonLaunch`` fields in ``LAUNCH_CHOICES``. The bound family is
    fixed to the grid (the clustered family has no CUDA kernels)."""

    name = "cuda"
    # the grid family's codes; certified steps of the histogram rule (the fused kernels refuse the
    # one-pass rule; triton_stream's is a dispatch choice, not a profile's; triton_tiled refuses the
    # a-posteriori rule, and no H200 study has measured it yet)
    fixed_config = {"family": ["grid"], "certified_passes": [2], "certified_rule": ["histogram"]}
    code_layout = "token"  # the Triton kernels read token rows (also when interpreted on CPU)

    def __init__(self, repeats: int = 20, warmup: int = 3, device: str = "cuda") -> None:
        self._timer = CudaEventTimer(repeats, max(warmup, 1))
        self.device = torch.device(device)

    def launch_space(self) -> dict[str, BaseDistribution]:
        return {name: CategoricalDistribution(list(values)) for name, values in LAUNCH_CHOICES.items()}

    def default_launch(self) -> dict[str, Any]:
        defaults = {**asdict(TritonLaunch()), "cuda_decode": "triton"}
        return {name: defaults[name] for name in LAUNCH_CHOICES}

    def timer(self) -> CudaEventTimer:
        return self._timer

    def place(self, batch: PagedBatch) -> PagedBatch:
        to = lambda t: t.to(self.device)
        return PagedBatch(to(batch.q), to(batch.k), to(batch.v), to(batch.page_table).int(),
                          to(batch.seq_lens).int(), batch.sigma)

    def make_step(self, batch: PagedBatch, store: PageIndexStore, config: LouverConfig,
                  launch: Mapping[str, Any]) -> StepFn:
        known = {f.name for f in fields(TritonLaunch)}
        triton_launch = TritonLaunch.from_dict({k: v for k, v in launch.items() if k in known})
        q = batch.q.to(batch.k.dtype)
        shapes = HeadShapes(q.shape[1], batch.k.shape[1], batch.k.shape[2], batch.v.shape[2])
        decode = LouverDecode(config, self.device, impl=launch.get("cuda_decode", "triton"), launch=triton_launch,
                              shapes=shapes, max_batch=q.shape[0], max_pages=batch.page_table.shape[1])
        decode.plan(batch.page_table, batch.seq_lens)  # into the workspace, once: the graph replays the run
        out = torch.empty_like(q)

        def step():
            step_result = decode.run(q, batch.k, batch.v, store, batch.sigma, out=out, stats=True)
            return step_result.out, step_result.stats
        return step
