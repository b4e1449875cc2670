"""``ThresholdPolicy`` (``config.threshold``): the one reader of a config's policy fields."""

from __future__ import annotations

import math

import pytest
import torch

from louver_sgl import LouverConfig
from louver_sgl.policy import ThresholdPolicy


@pytest.mark.parametrize("changes, dense, fixed, budget, certified, one_pass, a_post, gates, static", [
    ({"policy": "dense"}, True, False, False, False, False, False, False, -math.inf),
    ({"policy": "fixed", "fixed_threshold": 1.5}, False, True, False, False, False, False, True, 1.5),
    ({"policy": "fixed", "value_gate": False}, False, True, False, False, False, False, False, 0.0),
    ({"policy": "budget"}, False, False, True, False, False, False, True, None),
    ({"policy": "certified"}, False, False, False, True, False, False, False, None),
    ({"policy": "certified", "certified_passes": 1}, False, False, False, True, True, False, False, None),
    ({"policy": "certified", "certified_rule": "a_posteriori"}, False, False, False, True, False, True, False, None),
    ({"policy": "certified", "certified_rule": "a_posteriori", "certified_passes": 1}, False, False, False, True, True,
     True, False, None),
    # the certified knobs mean nothing under another policy
    ({"policy": "budget", "certified_rule": "a_posteriori"}, False, False, True, False, False, False, True, None),
])
def test_each_policy_answers_which_rule_runs(changes, dense, fixed, budget, certified, one_pass, a_post, gates,
                                             static):
    p = LouverConfig(**changes).threshold
    assert (p.dense, p.fixed, p.budget_rule, p.certified) == (dense, fixed, budget, certified)
    assert (p.one_pass, p.a_posteriori, p.gates_values, p.static_threshold) == (one_pass, a_post, gates, static)
    assert p.band_pass == (a_post and not one_pass) and p.one_pass_a_posteriori == (a_post and one_pass)


def test_kernel_arguments_and_the_certificate_check():
    budget = LouverConfig(policy="budget", budget=0.05).threshold
    certified = LouverConfig(policy="certified", eps=1e-2).threshold
    assert budget.kernel_budget() == 0.05 and certified.kernel_budget() == -1.0
    assert certified.kernel_eps_budget(0.5) == pytest.approx(5e-3) and budget.kernel_eps_budget(0.5) == -1.0
    assert certified.certifies(torch.tensor([1e-3, 9e-3])) and not certified.certifies(torch.tensor([1e-3, 1e-2]))
    assert budget.certifies(torch.tensor([0.5]))  # nothing to certify


def test_the_policy_follows_the_config_it_came_from():
    config = LouverConfig(policy="budget")
    assert config.threshold is config.threshold  # built once per config
    assert config.with_(policy="dense").threshold.dense and not config.threshold.dense
    assert ThresholdPolicy.of(config) == config.threshold
