"""The int8 weight rules study (benchmarks/studies/int8_weight_rules.py) on synthetic keys: every
rule's bounds keep every key at or above T (the study raises otherwise), ±127's step is 63/127 of
±63's, and the lane groups' step lies between ±127's and the group sum's worst case (4x ±127's)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.studies.int8_weight_rules import layer_rows


def test_rules_keep_every_key_and_order_their_steps():
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(512, 2, 64, generator=gen)
    keys[..., 5] *= 8  # one heavy channel, as real keys have
    queries = torch.randn(3, 6, 64, generator=gen)
    rows = layer_rows(keys, queries, page=64, quantile=0.9)
    assert rows["±127"]["step_over_pm63_median"] == pytest.approx(63 / 127, rel=1e-5)
    assert 63 / 127 <= rows["lane groups"]["step_over_pm63_median"] <= 4 * 63 / 125
    for rule in rows.values():
        assert 0.1 < rule["gqa_union"] <= 1.0
