"""``ThresholdPolicy``: how a decode step chooses T, as one object.

``LouverConfig`` stores the policy as plain fields (``policy``, ``eps``, ``budget``,
``fixed_threshold``, ``certified_passes``, ``certified_rule``, ``estimate_share``, ``value_gate``),
so that profiles and ``LOUVER_*`` variables can set them. Everything that asks which rule a step
runs asks this object (``config.threshold``), never the strings: the implementations, the
reference, the threshold rules and the tuner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ThresholdPolicy:
    """The threshold rule of a config (see ``LouverConfig`` for each parameter's meaning).

    kind: "certified", "budget", "fixed" or "dense". eps, budget, fixed_threshold: the rules'
    parameters. passes, rule, estimate_share: how a certified step finds T. value_gate: whether
    budget and fixed steps skip the V reads of candidates below T.
    """

    kind: str
    eps: float
    budget: float
    fixed_threshold: float
    passes: int
    rule: str
    estimate_share: float
    value_gate: bool

    @classmethod
    def of(cls, config) -> ThresholdPolicy:
        """The policy of a ``LouverConfig`` (this module imports none: the config holds its policy)."""
        return cls(config.policy, float(config.eps), float(config.budget), float(config.fixed_threshold),
                   int(config.certified_passes), config.certified_rule, float(config.estimate_share),
                   bool(config.value_gate))

    @property
    def dense(self) -> bool:
        """T = −inf: every key attended."""
        return self.kind == "dense"

    @property
    def fixed(self) -> bool:
        return self.kind == "fixed"

    @property
    def budget_rule(self) -> bool:
        """T from the sample's quantile at ``budget``."""
        return self.kind == "budget"

    @property
    def certified(self) -> bool:
        """T chosen so the dropped softmax mass is provably below ``eps``."""
        return self.kind == "certified"

    @property
    def one_pass(self) -> bool:
        """A certified step gated at its provisional level, checked by its own attend pass."""
        return self.certified and self.passes == 1

    @property
    def a_posteriori(self) -> bool:
        """A certified step whose first level fits an estimate of Z and whose check divides by
        Z_att, the exact mass it attended (with either pass count)."""
        return self.certified and self.rule == "a_posteriori"

    @property
    def band_pass(self) -> bool:
        """The two-pass a-posteriori rule: the first level from the histogram, lowered where the
        check fails, with a band pass over the keys between the two levels."""
        return self.a_posteriori and self.passes == 2

    @property
    def one_pass_a_posteriori(self) -> bool:
        """The one-pass rule with its provisional level from the estimate of Z, checked against
        Z_att; a request with a failing head takes the histogram rule."""
        return self.a_posteriori and self.passes == 1

    @property
    def gates_values(self) -> bool:
        """Whether candidates scoring below T skip their V read (budget and fixed policies; a
        certified step attends every candidate, so its bound is the index bound alone)."""
        return self.value_gate and self.kind in ("budget", "fixed")

    @property
    def static_threshold(self) -> float | None:
        """T of the policies that need no data (−inf for dense, ``fixed_threshold``); else None."""
        if self.dense:
            return -math.inf
        return self.fixed_threshold if self.fixed else None

    def kernel_budget(self) -> float:
        """The compiled exact part's ``budget`` argument: the quantile with the budget rule, −1
        (no quantile) otherwise."""
        return self.budget if self.budget_rule else -1.0

    def kernel_eps_budget(self, safety: float) -> float:
        """The compiled certified passes' ``eps_budget``: eps·safety when certified, −1 otherwise."""
        return self.eps * safety if self.certified else -1.0

    def certifies(self, mass_bound) -> bool:
        """Whether every reported dropped-mass bound (a tensor) is below eps; True unless certified."""
        return not self.certified or bool((mass_bound.cpu() < self.eps).all())
