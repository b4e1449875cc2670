"""Tuned profile vs built-in defaults vs the best point of an exhaustive grid, timed in one run.

The points are timed interleaved (round-robin over rounds, cases and points) with the CPU
target's wall-clock timer on the tuning cases; the per-case latency is the median over rounds.
With ``--tpe-study`` it also reports after how many trials a TPE study over the grid's sub-space
first came within 5 % of the grid's best value (both values from their own studies).

    python -m benchmarks.studies.tune_compare --profile louver_sgl/profiles/cpu_amd_epyc_avx512.json \\
        --storage sqlite:///louver-tune.db --grid-study GRID --tpe-study TPE \\
        --out benchmarks/results/tune_cpu.json
"""

from __future__ import annotations

import argparse
import json
import math
from datetime import date
from pathlib import Path

import optuna
import torch
from optuna.trial import TrialState

from louver_sgl.profiles import Profile
from louver_tuning.confirm import time_points
from louver_tuning.cpu import CpuTarget
from louver_tuning.storage import open_storage
from louver_tuning.study import TuneSettings
from benchmarks.record import command_line


def grid_point(storage: str, name: str, launch_names: set[str]) -> tuple[dict, dict, float, int]:
    study = optuna.load_study(storage=open_storage(storage), study_name=name)
    best = study.best_trial
    config = {k: v for k, v in best.params.items() if k not in launch_names}
    launch = {k: v for k, v in best.params.items() if k in launch_names}
    return config, launch, best.value, len(study.trials)


def trials_to_within(storage: str, name: str, target_value: float, tolerance: float = 0.05) -> dict:
    """First trial number at which the best-so-far value is within ``tolerance`` of ``target_value``."""
    study = optuna.load_study(storage=open_storage(storage), study_name=name)
    best_so_far, reached = math.inf, None
    for t in sorted(study.trials, key=lambda t: t.number):
        if t.state == TrialState.COMPLETE:
            best_so_far = min(best_so_far, t.value)
            if reached is None and best_so_far <= (1 + tolerance) * target_value:
                reached = t.number + 1
    return {"study": name, "trials": len(study.trials), "best_value_ms": best_so_far,
            "trials_to_within_5pct_of_grid_best": reached}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", required=True)
    parser.add_argument("--storage", default="sqlite:///louver-tune.db")
    parser.add_argument("--grid-study")
    parser.add_argument("--tpe-study")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/tune_cpu.json")
    args = parser.parse_args()
    profile = Profile.load(args.profile)
    s = profile.measured["settings"]
    settings = TuneSettings(**{k: tuple(v) if isinstance(v, list) else v for k, v in s.items()})
    launch_names = set(profile.launch)
    target = CpuTarget()
    points = {"defaults": ({}, target.default_launch()), "tuned": (dict(profile.config), dict(profile.launch))}
    extra = {}
    if args.grid_study:
        config, launch, value, n = grid_point(args.storage, args.grid_study, launch_names)
        points["grid_best"] = (config, launch)
        extra["grid"] = {"study": args.grid_study, "points": n, "best_value_ms": value}
        if args.tpe_study:
            extra["tpe_small_space"] = trials_to_within(args.storage, args.tpe_study, value)
    timed = time_points(CpuTarget(settings.repeats, settings.warmup), settings, points, args.rounds)
    result = {"date": str(date.today()), "command": command_line(),
              "machine": {"device": profile.device_name, "threads": torch.get_num_threads(), "torch": torch.__version__},
              "profile": args.profile, "settings": s, "rounds": args.rounds, "points": timed, **extra}
    for name in timed:
        result["points"][name]["speedup_vs_defaults"] = timed["defaults"]["geomean_ms"] / timed[name]["geomean_ms"]
    if "grid_best" in timed:
        result["tuned_vs_grid_best"] = timed["tuned"]["geomean_ms"] / timed["grid_best"]["geomean_ms"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for name, r in timed.items():
        cases = " ".join(f"{c}={v:.2f}" for c, v in r["case_ms"].items())
        print(f"{name:10} geomean {r['geomean_ms']:7.2f} ms  x{r['speedup_vs_defaults']:.2f} vs defaults  {cases}")
    print(json.dumps(extra, indent=1))


if __name__ == "__main__":
    main()
