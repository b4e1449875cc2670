"""Run or resume a tuning study, and turn its best trial into a profile."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from datetime import date
from typing import Any, Callable, Sequence

import optuna
import torch
from optuna.trial import TrialState

import louver_sgl
from louver_sgl import LouverConfig
from louver_eval.data.capture import ensure_traces, load_trace
from louver_sgl.profiles import Profile, Shapes

from .objective import CaseGroup, Objective, RatioPruner
from .space import SearchSpace, build_space, policy_space
from .storage import open_storage
from .target import Target, Timer
from .validate import ConstraintViolation
from .workload import Case, Workload, parse_case

TraceLoader = Callable[[str, int], dict]


@dataclass(frozen=True)
class TuneSettings:
    """Everything that defines a study's objective (stored with the study; a resumed study must match)."""

    cases: tuple[str, ...] = ("8192x1", "8192x8", "32768x1", "32768x8")
    text: str = "bible"
    layers: tuple[int, ...] = (9, 21)
    validation: tuple[str, ...] = ("2048x2",)
    validation_text: str = "paul_graham"
    policy: str = "certified"
    eps: float = 1e-3
    kv_dtype: str = "float16"
    space: str = "full"
    repeats: int = 5
    warmup: int = 1
    budget: float = LouverConfig.budget  # the budget policy's fraction of keys

    def objective_key(self) -> dict[str, Any]:
        """The stored objective; ``budget`` only where the policy reads it (studies of the other
        policies resume as before it existed)."""
        key = dataclasses.asdict(self)
        if not self.base_config().threshold.budget_rule:
            key.pop("budget")
        return key

    def base_config(self) -> LouverConfig:
        """The accuracy contract trials run under."""
        return LouverConfig(policy=self.policy, eps=self.eps, budget=self.budget)


@dataclass(frozen=True)
class RunOptions:
    """How this invocation searches (may change between resumed runs)."""

    trials: int = 60
    timeout: float | None = None
    sampler: str = "tpe"
    seed: int = 0
    prune_ratio: float = 3.0
    progress: bool = True


def default_trace_loader(text: str, length: int) -> dict:
    """The captured trace of ``text`` at ``length`` tokens (captured first if missing: slow)."""
    (path,) = ensure_traces([length], text=text)
    return load_trace(path)


def shapes_of(settings: TuneSettings, trace: dict) -> Shapes:
    meta = trace["meta"]
    lengths = sorted({parse_case(c)[0] for c in settings.cases})
    batches = sorted({parse_case(c)[1] for c in settings.cases})
    return Shapes(int(meta["head_dim"]), int(meta["num_heads"]), int(meta["num_kv_heads"]), settings.kv_dtype,
                  tuple(lengths), tuple(batches), settings.policy, settings.eps)


def default_study_name(target: Target, shapes: Shapes, settings: TuneSettings) -> str:
    return (f"{target.profile_key()}-d{shapes.head_dim}-q{shapes.num_q_heads}-kv{shapes.num_kv_heads}-"
            f"{shapes.kv_dtype}-{settings.policy}-{settings.space}")


def make_objective(target: Target, settings: TuneSettings, loader: TraceLoader, timer: Timer | None,
                   space: SearchSpace) -> Objective:
    base = settings.base_config()
    groups = []
    for spec in settings.cases:
        length, batch = parse_case(spec)
        trace = loader(settings.text, length)
        groups.append(CaseGroup(spec, tuple(Case(f"{spec}/L{layer}", trace, batch, layer) for layer in settings.layers)))
    validation = []
    for spec in settings.validation:
        length, batch = parse_case(spec)
        trace = loader(settings.validation_text, length)
        validation += [Case(f"val:{settings.validation_text}:{spec}/L{layer}", trace, batch, layer)
                       for layer in trace["keys"]]
    workload = Workload(target, getattr(torch, settings.kv_dtype))
    return Objective(target, space, base, groups, validation, workload, timer)


def open_study(storage_url: str | None, study_name: str, sampler: optuna.samplers.BaseSampler | None = None,
               pruner: optuna.pruners.BasePruner | None = None, create: bool = True) -> optuna.Study:
    storage = open_storage(storage_url)
    if create:
        return optuna.create_study(storage=storage, study_name=study_name, direction="minimize",
                                   sampler=sampler, pruner=pruner, load_if_exists=True)
    return optuna.load_study(storage=storage, study_name=study_name, sampler=sampler, pruner=pruner)


def run_tune(target: Target, settings: TuneSettings, run: RunOptions, storage_url: str | None = None,
             study_name: str | None = None, loader: TraceLoader = default_trace_loader,
             timer: Timer | None = None, space: SearchSpace | None = None,
             seeds: Sequence[tuple[dict[str, Any], str]] | None = None) -> optuna.Study:
    """Create or resume the study and run ``run.trials`` more trials. A new study's first trials
    are ``seeds`` (params, role), by default the built-in defaults (role ``defaults``)."""
    first = loader(settings.text, parse_case(settings.cases[0])[0])
    shapes = shapes_of(settings, first)
    max_context = max(parse_case(c)[0] for c in settings.cases)
    space = policy_space(space or build_space(target.launch_space(), max_context, settings.space), settings.policy,
                         target.default_launch())
    fixed = getattr(target, "fixed_config", None)  # knobs a target supports one value of
    if fixed:
        space = space.restrict({k: v for k, v in fixed.items() if k in space.distributions})
    study_name = study_name or default_study_name(target, shapes, settings)
    study = open_study(storage_url, study_name, make_sampler(run, space), RatioPruner(run.prune_ratio))
    _check_or_record(study, target, settings, shapes)
    if not study.trials and run.sampler != "grid":
        for params, role in seeds if seeds is not None else [(space.defaults(target.default_launch()), "defaults")]:
            study.enqueue_trial(space.held(params), user_attrs={"role": role})
    objective = make_objective(target, settings, loader, timer, space)
    study.optimize(objective, n_trials=run.trials, timeout=run.timeout, catch=(ConstraintViolation,),
                   show_progress_bar=run.progress)
    return study


def make_sampler(run: RunOptions, space: SearchSpace) -> optuna.samplers.BaseSampler:
    if run.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=run.seed, multivariate=True, group=True, n_startup_trials=8)
    if run.sampler == "random":
        return optuna.samplers.RandomSampler(seed=run.seed)
    if run.sampler == "grid":
        return optuna.samplers.GridSampler(space.grid(), seed=run.seed)
    raise ValueError(f"sampler must be 'tpe', 'random' or 'grid', got {run.sampler!r}")


def _check_or_record(study: optuna.Study, target: Target, settings: TuneSettings, shapes: Shapes) -> None:
    """A resumed study must have the same objective; a new one records it."""
    key = settings.objective_key()
    stored = study.user_attrs.get("settings")
    if stored is not None:
        stored = {k: tuple(v) if isinstance(v, list) else v for k, v in stored.items()}
        if stored != key or study.user_attrs.get("target") != target.name:
            raise ValueError(f"study {study.study_name!r} was created with other settings "
                             f"({stored}, target {study.user_attrs.get('target')}); pass another --study-name")
        return
    study.set_user_attr("settings", key)
    study.set_user_attr("target", target.name)
    study.set_user_attr("device_name", target.device_name())
    study.set_user_attr("shapes", dataclasses.asdict(shapes))
    study.set_user_attr("louver_version", louver_sgl.__version__)
    study.set_user_attr("command", " ".join(["louver-tune"] + sys.argv[1:]))
    study.set_user_attr("date", str(date.today()))


BASELINE_ROLES = ("defaults", "nearest")  # a study's baseline: the plain defaults, or (quick) the nearest profile


def best_and_defaults(study: optuna.Study) -> tuple[optuna.trial.FrozenTrial, optuna.trial.FrozenTrial | None]:
    """The best complete trial and the baseline trial (None if it did not complete)."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not complete:
        raise ValueError(f"study {study.study_name!r} has no complete trial to export")
    defaults = next((t for t in complete if t.user_attrs.get("role") in BASELINE_ROLES), None)
    return min(complete, key=lambda t: t.value), defaults


def study_profile(study: optuna.Study, launch_names: set[str], confirmation: dict | None = None) -> Profile:
    """The profile of the study's best complete trial, with defaults-vs-tuned from the same study;
    with a ``confirmation`` (``confirm.confirm_best``) the re-timed winner and its same-run speedup."""
    best, defaults = best_and_defaults(study)
    speedup = defaults.value / best.value if defaults else None
    if confirmation is not None:
        best = study.trials[confirmation["winner"]]
        timed = confirmation["timed"]
        if confirmation["defaults"] is not None:
            speedup = timed[str(confirmation["defaults"])]["geomean_ms"] / timed[str(best.number)]["geomean_ms"]
    attrs = study.user_attrs
    params = {k: round(v, 6) if isinstance(v, float) else v for k, v in best.params.items()}  # 0.9000000000000001
    config = {k: v for k, v in params.items() if k not in launch_names}
    launch = {k: v for k, v in params.items() if k in launch_names}
    shapes = Shapes(**{k: tuple(v) if isinstance(v, list) else v for k, v in attrs["shapes"].items()})
    counts = {s.name.lower(): len(study.get_trials(deepcopy=False, states=(s,)))
              for s in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)}
    role = defaults.user_attrs.get("role", "defaults") if defaults else "defaults"
    measured = {
        "objective": "geometric mean over cases of the decode-step latency (ms, mean over layers)",
        "tuned": _trial_summary(best),
        role: _trial_summary(defaults) if defaults else None,
        f"speedup_vs_{role}": speedup,
        "confirmation": confirmation,
        "trials": counts, "study_name": study.study_name, "settings": attrs["settings"],
        "date": attrs.get("date"), "command": attrs.get("command"),
    }
    return Profile(attrs["target"], attrs["device_name"], attrs["louver_version"], config, launch, shapes, measured)


def _trial_summary(trial: optuna.trial.FrozenTrial) -> dict[str, Any]:
    return {"trial": trial.number, "value_ms": trial.value, "params": dict(trial.params),
            "case_ms": {k[3:]: v for k, v in trial.user_attrs.items() if k.startswith("ms:")}}
