"""The trial objective: validate, then time the decode step case by case, pruning hopeless trials.

Value: the geometric mean over the cases of the per-case latency (ms; each case's latency is the
mean over its layers), so every (context length, batch size) counts the same in relative terms.
Each case's latency is reported as an intermediate value (step = case index, cases cheapest
first) so ``RatioPruner`` can stop a trial that is already far slower than the best one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import optuna
from optuna.pruners import BasePruner
from optuna.trial import FrozenTrial, TrialState

from louver_sgl import LouverConfig

from .space import SearchSpace
from .target import Target, TimedPoint, Timer
from .validate import ConstraintViolation, check_step
from .workload import Case, Workload


@dataclass(frozen=True)
class CaseGroup:
    """The layers of one (context length, batch size): timed together, reported as one step."""

    name: str
    cases: tuple[Case, ...]


class Objective:
    """Callable objective holding the target, space, workload and validation set (Optuna FAQ idiom)."""

    def __init__(self, target: Target, space: SearchSpace, base: LouverConfig, groups: Sequence[CaseGroup],
                 validation: Sequence[Case], workload: Workload, timer: Timer | None = None) -> None:
        self.target, self.space, self.base = target, space, base
        self.groups, self.validation, self.workload = list(groups), list(validation), workload
        self.timer = timer or target.timer()

    def __call__(self, trial: optuna.Trial) -> float:
        config_over, launch = self.space.split(self.space.suggest(trial))
        try:
            config = self.base.with_(**config_over)
        except ValueError as exc:
            reject(trial, f"invalid config: {exc}")
        for case in self.validation:
            self._validate(trial, case, config, launch)
        latencies = []
        for step, group in enumerate(self.groups):
            ms = sum(self._time(trial, case, config, launch) for case in group.cases) / len(group.cases)
            latencies.append(ms)
            trial.set_user_attr(f"ms:{group.name}", ms)
            trial.report(ms, step)
            if trial.should_prune():
                raise optuna.TrialPruned(f"{group.name}: {ms:.2f} ms")
        return math.exp(sum(math.log(x) for x in latencies) / len(latencies))

    def _validate(self, trial, case: Case, config: LouverConfig, launch: Mapping[str, Any]) -> None:
        batch, store = self.workload.get(case, config)
        out, stats = self.target.make_step(batch, store, config, launch)()
        try:
            check_step(batch, store, config, out, stats, residual_weights=bool(launch.get("residual_weights", False)))
        except ConstraintViolation as exc:
            reject(trial, f"validation {case.name}: {exc}")

    def _time(self, trial, case: Case, config: LouverConfig, launch: Mapping[str, Any]) -> float:
        batch, store = self.workload.get(case, config)
        step = self.target.make_step(batch, store, config, launch)
        _, stats = step()
        if not config.threshold.certifies(stats.mass_bound):
            reject(trial, f"{case.name}: certified bound {float(stats.mass_bound.max()):.3g} >= eps {config.eps}")
        return self.timer(step, TimedPoint(case.name, config, dict(launch)))


def reject(trial: optuna.Trial, reason: str) -> None:
    """Record why and fail the trial (the study catches ``ConstraintViolation``: state FAIL)."""
    trial.set_user_attr("rejected", reason)
    raise ConstraintViolation(reason)


class RatioPruner(BasePruner):
    """Prune when a case's latency exceeds ``ratio`` x the best complete trial's latency on that case."""

    def __init__(self, ratio: float = 3.0) -> None:
        if not ratio > 1.0:
            raise ValueError(f"prune ratio must be > 1, got {ratio}")
        self.ratio = ratio

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        step = trial.last_step
        if step is None:
            return False
        best = [t.intermediate_values[step] for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if step in t.intermediate_values]
        return bool(best) and trial.intermediate_values[step] > self.ratio * min(best)
