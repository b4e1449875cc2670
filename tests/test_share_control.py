"""The a-posteriori estimate share per request and layer (``decode.share_control``) and the config
option that turns it on (``estimate_share_max``)."""

from __future__ import annotations

import math

import pytest
import torch

from louver_sgl import LouverConfig
from louver_sgl.decode.share_control import RAISE_AFTER, RAISE_BELOW, SHARE_FLOOR, STEP, ShareControl

ADAPTIVE = LouverConfig(policy="certified", eps=1e-2, certified_passes=1, certified_rule="a_posteriori",
                        estimate_share=8.0, estimate_share_max=16.0)


def _step(control, keys, lowered_keys=(), bound=0.1):
    """One step of ``keys``: those in ``lowered_keys`` had a lowered head (one of three); every
    other head's bound is ``bound``·eps."""
    lowered = torch.zeros(len(keys), 3, dtype=torch.bool)
    for i, key in enumerate(keys):
        lowered[i, 1] = key in lowered_keys
    control.update(keys, lowered, torch.where(lowered, 0.99, bound) * ADAPTIVE.eps)


def test_a_share_starts_at_the_config_falls_on_a_lowered_head_and_rises_after_clean_steps():
    control = ShareControl(ADAPTIVE)
    assert control.shares(["a", "b"]).tolist() == [8.0, 8.0] and control.shares([]).shape == (0,)
    _step(control, ["a", "b"], lowered_keys={"a"})
    assert control.shares(["a", "b"]).tolist() == [pytest.approx(8.0 / STEP), 8.0]  # each key its own
    _step(control, ["a"], lowered_keys={"a"})
    assert control.share("a") == pytest.approx(4.0)
    for _ in range(RAISE_AFTER - 1):
        _step(control, ["a"])
    assert control.share("a") == pytest.approx(4.0)
    _step(control, ["a"])
    assert control.share("a") == pytest.approx(4.0 * STEP)  # the RAISE_AFTER-th clean step in a row
    for _ in range(10 * RAISE_AFTER):
        _step(control, ["a"])
    assert control.share("a") == 16.0  # capped at estimate_share_max
    for _ in range(RAISE_AFTER - 1):
        _step(control, ["c"])
    _step(control, ["c"], lowered_keys={"c"})  # a failure resets the count of clean steps
    for _ in range(RAISE_AFTER - 1):
        _step(control, ["c"])
    assert control.share("c") == pytest.approx(8.0 / STEP)
    for _ in range(20):
        _step(control, ["c"], lowered_keys={"c"})
    assert control.share("c") == SHARE_FLOOR


def test_a_share_rises_only_on_a_step_whose_bound_leaves_room():
    """Clean steps near the budget (bound ≥ RAISE_BELOW·eps, or NaN) keep the share; the first
    clean step with room after RAISE_AFTER raises it."""
    control = ShareControl(ADAPTIVE)
    for bound in [0.9] * (2 * RAISE_AFTER) + [float("nan"), RAISE_BELOW]:
        _step(control, ["a"], bound=bound)
    assert control.share("a") == 8.0
    _step(control, ["a"], bound=RAISE_BELOW * 0.99)
    assert control.share("a") == pytest.approx(8.0 * STEP)


def test_the_floor_is_the_start_when_the_start_is_lower():
    control = ShareControl(ADAPTIVE.with_(estimate_share=0.5, estimate_share_max=2.0))
    for _ in range(3):
        _step(control, [0], lowered_keys={0})
    assert control.share(0) == 0.5


def test_the_least_recently_used_keys_are_forgotten_past_the_capacity():
    control = ShareControl(ADAPTIVE, capacity=2)
    _step(control, ["a", "b"], lowered_keys={"a", "b"})
    _step(control, ["a"], lowered_keys={"a"})  # a is used last: b goes first
    _step(control, ["c"], lowered_keys={"c"})
    assert control.tracked == 2 and control.share("b") == 8.0 and control.share("a") == pytest.approx(4.0)
    assert control.share("c") == pytest.approx(8.0 / STEP)


def test_update_reads_lowered_per_request_or_per_head():
    control = ShareControl(ADAPTIVE)
    control.update(["a", "b"], torch.tensor([True, False]), torch.tensor([0.01, 0.001]))
    assert control.shares(["a", "b"]).tolist() == [pytest.approx(8.0 / STEP), 8.0]
    control.update([], torch.zeros(0, 3, dtype=torch.bool), torch.zeros(0, 3))


def test_update_from_packed_step_stats_moves_shares_as_update():
    """update_step reads the compiled step's packed statistics in one host copy; the shares move
    as update moves them from the unpacked fields (NaN bounds leave no room, lowered heads fail)."""
    from louver_sgl.decode.contract import StepStats

    gen = torch.Generator().manual_seed(3)
    by_fields, by_packed = ShareControl(ADAPTIVE), ShareControl(ADAPTIVE)
    keys = ["a", "b", "c"]
    for step in range(4 * RAISE_AFTER):
        packed = torch.zeros(3, 5, 5, dtype=torch.float64)
        packed[:, :4, 3] = torch.rand(3, 4, generator=gen, dtype=torch.float64) * ADAPTIVE.eps * 0.7
        packed[:, :4, 4] = (torch.rand(3, 4, generator=gen) < 0.03).double()
        if step % 7 == 0:
            packed[1, 2, 3] = float("nan")
        num = torch.tensor([640, 320, 128])
        eager = StepStats.from_packed(packed.clone(), num, num // 64)
        by_fields.update(keys, eager.lowered.clone(), eager.mass_bound)
        lazy = StepStats.from_packed(packed, num, num // 64)
        by_packed.update_step(keys, lazy)
        assert lazy.packed is not None  # read without unpacking
        assert by_packed.shares(keys).tolist() == by_fields.shares(keys).tolist()
    assert len(set(by_fields.shares(keys).tolist())) > 1  # the shares did move apart
    unpacked = StepStats.from_packed(torch.zeros(1, 5, 5, dtype=torch.float64), torch.tensor([64]), torch.tensor([1]))
    unpacked.candidates
    by_packed.update_step(["d"], unpacked)  # an unpacked (or another implementation's) StepStats
    by_packed.update_step([], unpacked)


@pytest.mark.parametrize("config", [ADAPTIVE.with_(estimate_share_max=0.0), ADAPTIVE.with_(estimate_share_max=8.0),
                                    ADAPTIVE.with_(certified_rule="histogram"),
                                    ADAPTIVE.with_(policy="budget")])
def test_a_config_that_keeps_one_share_has_no_control(config):
    assert not config.adaptive_share
    with pytest.raises(ValueError, match="estimate_share_max above estimate_share"):
        ShareControl(config)


@pytest.mark.parametrize("bad", [4.0, 33.0, float("nan"), -1.0])
def test_estimate_share_max_is_zero_or_between_the_share_and_32(bad):
    with pytest.raises(ValueError, match="estimate_share_max"):
        ADAPTIVE.with_(estimate_share_max=bad)
    assert ADAPTIVE.with_(estimate_share_max=32.0).adaptive_share
    assert LouverConfig().estimate_share_max == 0.0 and not LouverConfig().adaptive_share
