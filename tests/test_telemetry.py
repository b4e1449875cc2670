"""Serving telemetry: recorded steps are summed lazily, with the same window as summing at once."""

from __future__ import annotations

import torch

from louver_sgl.decode.contract import StepStats
from louver_sgl.serving import telemetry
from louver_sgl.serving.telemetry import Telemetry


def _stats(seed: int) -> StepStats:
    gen = torch.Generator().manual_seed(seed)
    packed = torch.rand(2, 5, 4, generator=gen, dtype=torch.float64).mul(100).floor()
    packed[:, 4, 0] = torch.tensor([float(seed % 2), 0.0])  # dense fallback flags
    return StepStats.from_packed(packed, torch.tensor([640, 320]), torch.tensor([10, 5]))


def test_window_sums_recorded_steps_and_bounds_what_it_holds(monkeypatch):
    monkeypatch.setattr(telemetry, "PENDING_LIMIT", 3)
    tel = Telemetry(interval=0)
    steps = [_stats(seed) for seed in range(7)]
    for stats in steps:
        tel.record_step(stats)
        assert len(tel.window.pending) < 3
    snap = tel.snapshot()
    candidates = sum(float(s.candidates.sum()) for s in steps)
    skipped = sum(float(s.pages_skipped.sum()) for s in steps)
    assert tel.window.layer_steps == 7 and not tel.window.pending
    assert snap["candidate_fraction"] == candidates / (7 * 960 * 4)
    assert snap["pages_skipped_fraction"] == skipped / (7 * 15 * 4)
    assert snap["mass_bound_max"] == max(float(s.mass_bound.max()) for s in steps)
    assert snap["dense_fallback_fraction"] == 3 / 14  # seeds 1, 3, 5 flag their first request
