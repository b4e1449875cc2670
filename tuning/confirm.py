"""Re-time candidate points interleaved in one run before a profile is written.

Trial values come from different moments of a study; on a shared machine the load changes
between trials, so a trial can win by having run in a quiet minute. Export therefore re-times the
best few trials and the defaults round-robin (rounds x cases x points) and keeps the point that is
fastest in that same run; when the defaults win, the profile holds the defaults.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Mapping

import optuna
from optuna.trial import TrialState
from tqdm import tqdm

from .space import build_space
from .study import BASELINE_ROLES, TraceLoader, TuneSettings, default_trace_loader, make_objective
from .target import Target, TimedPoint

Point = tuple[Mapping[str, Any], Mapping[str, Any]]  # (LouverConfig overrides, launch)


def time_points(target: Target, settings: TuneSettings, points: Mapping[str, Point], rounds: int,
                loader: TraceLoader = default_trace_loader) -> dict[str, dict]:
    """Per point: case latencies (median over rounds of the mean over layers) and their geomean (ms)."""
    objective = make_objective(target, settings, loader, None, build_space(target.launch_space(), 1 << 30))
    base = settings.base_config()
    ms = {name: {g.name: [] for g in objective.groups} for name in points}
    jobs = [(g, name) for _ in range(rounds) for g in objective.groups for name in points]
    for group, name in tqdm(jobs, desc="re-timing"):
        config_over, launch = points[name]
        config = base.with_(**config_over)
        per_layer = []
        for case in group.cases:
            batch, store = objective.workload.get(case, config)
            step = target.make_step(batch, store, config, launch)
            per_layer.append(objective.timer(step, TimedPoint(case.name, config, dict(launch))))
        ms[name][group.name].append(sum(per_layer) / len(per_layer))
    result = {}
    for name, cases in ms.items():
        med = {c: statistics.median(v) for c, v in cases.items()}
        result[name] = {"config": dict(points[name][0]), "launch": dict(points[name][1]), "case_ms": med,
                        "geomean_ms": math.exp(sum(math.log(x) for x in med.values()) / len(med))}
    return result


def confirm_best(study: optuna.Study, target: Target, launch_names: set[str], top: int = 5, rounds: int = 3,
                 loader: TraceLoader = default_trace_loader) -> dict[str, Any]:
    """Re-time the ``top`` best complete trials and the baseline trial (the defaults, or the nearest
    profile of a quick study); the fastest wins.

    Returns ``{"winner": trial number, "defaults": the baseline's trial number or None, "rounds",
    "timed": {trial: result}}``.
    """
    complete = sorted(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)), key=lambda t: t.value)
    chosen = complete[:top] + [t for t in complete[top:] if t.user_attrs.get("role") in BASELINE_ROLES]
    points = {str(t.number): ({k: v for k, v in t.params.items() if k not in launch_names},
                              {k: v for k, v in t.params.items() if k in launch_names}) for t in chosen}
    settings = TuneSettings(**{k: tuple(v) if isinstance(v, list) else v
                               for k, v in study.user_attrs["settings"].items()})
    timed = time_points(target, settings, points, rounds, loader)
    defaults = next((t.number for t in chosen if t.user_attrs.get("role") in BASELINE_ROLES), None)
    winner = int(min(timed, key=lambda n: timed[n]["geomean_ms"]))
    return {"winner": winner, "defaults": defaults, "rounds": rounds, "timed": timed}
