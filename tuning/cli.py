"""``louver-tune`` (also ``python -m louver_tuning``): tune, show, export, list.

One command class per subcommand with ``add_arguments`` and ``take_action`` (Optuna's CLI layout).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from louver_sgl.profiles import Profile, ProfileError, find_profiles, profile_key
from louver_sgl.profiles.format import merge_tuned
from louver_sgl.profiles.select import profile_file_name
from louver_sgl.settings import Environment

from .quick import QUICK_CONFIRM, QUICK_RUN, QUICK_SETTINGS, nearest_seed, quick_space
from .report import importances, results_table, write_plots
from .storage import DEFAULT_STORAGE
from .study import RunOptions, TuneSettings, open_study, run_tune, study_profile
from .targets import get_target
from .workload import parse_case

DEFAULT_OUT_DIR = "louver-profiles"


def _study_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--storage", default=Environment.read().tune_storage or DEFAULT_STORAGE,
                        help="RDB URL (sqlite:///f.db, postgresql://...) or journal:PATH (default %(default)s)")
    parser.add_argument("--study-name", help="default: <device key>-<shapes>-<policy>-<space>")


class Tune:
    help = "run or resume a study for a target (--quick: a profile for this machine in minutes)"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--storage", help="RDB URL (sqlite:///f.db, postgresql://...) or journal:PATH (default "
                                         f"{Environment.read().tune_storage or DEFAULT_STORAGE}; --quick: in memory)")
        p.add_argument("--study-name", help="default: <device key>-<shapes>-<policy>-<space>")
        p.add_argument("--quick", action="store_true",
                       help="a profile in about 10 minutes: narrowed space seeded from the nearest profile, 16K "
                            "workloads, early pruning, exported where the backend finds it (docs/tuning.md)")
        d, q = TuneSettings(), QUICK_SETTINGS
        p.add_argument("--target", default="auto", help="auto, cpu or a registered target")
        p.add_argument("--cases", nargs="+", help=f"LENGTHxBATCH (default {' '.join(d.cases)}; --quick {' '.join(q.cases)})")
        p.add_argument("--text", default=d.text)
        p.add_argument("--layers", type=int, nargs="+", default=list(d.layers))
        p.add_argument("--validation", nargs="+", default=list(d.validation), help="LENGTHxBATCH of the validation set")
        p.add_argument("--validation-text", default=d.validation_text)
        p.add_argument("--policy", default=d.policy, choices=["certified", "budget", "fixed", "dense"])
        p.add_argument("--eps", type=float, default=d.eps)
        p.add_argument("--budget", type=float, default=d.budget, help="the budget policy's fraction of keys "
                                                                       f"(default {d.budget:g}, LouverConfig's)")
        p.add_argument("--kv-dtype", default=d.kv_dtype, choices=["float16", "bfloat16", "float32"])
        p.add_argument("--space", choices=["full", "small"], help="default full (--quick: its own narrowed space)")
        p.add_argument("--repeats", type=int, help=f"timed runs per point (default {d.repeats}; --quick {q.repeats})")
        p.add_argument("--warmup", type=int, default=d.warmup)
        r, qr = RunOptions(), QUICK_RUN
        p.add_argument("--trials", type=int, help=f"trials to add in this run (default {r.trials}; --quick {qr.trials})")
        p.add_argument("--timeout", type=float, help=f"seconds of trials in this run (default none; --quick {qr.timeout:g})")
        p.add_argument("--sampler", default=r.sampler, choices=["tpe", "random", "grid"])
        p.add_argument("--seed", type=int, default=r.seed)
        p.add_argument("--prune-ratio", type=float,
                       help=f"prune a trial whose case latency exceeds this x the best trial's (default {r.prune_ratio:g}; "
                            f"--quick {qr.prune_ratio:g})")
        p.add_argument("--export", metavar="DIR", help="export the profile (and plots) into DIR afterwards (--quick: "
                                                       "the user profile directory the backend searches)")
        _report_args(p)
        _confirm_args(p, QUICK_CONFIRM)
        _replace_arg(p)

    def take_action(self, a: argparse.Namespace) -> int:
        started = time.monotonic()
        base, run_base = (QUICK_SETTINGS, QUICK_RUN) if a.quick else (TuneSettings(), RunOptions())
        pick = lambda value, default: default if value is None else value  # noqa: E731
        settings = TuneSettings(tuple(pick(a.cases, base.cases)), a.text, tuple(a.layers), tuple(a.validation),
                                a.validation_text, a.policy, a.eps, a.kv_dtype, pick(a.space, base.space),
                                pick(a.repeats, base.repeats), a.warmup, a.budget)
        run = RunOptions(pick(a.trials, run_base.trials), pick(a.timeout, run_base.timeout), a.sampler, a.seed,
                         pick(a.prune_ratio, run_base.prune_ratio))
        target = get_target(a.target, settings.repeats, settings.warmup)
        print(f"target {target.name}: {target.device_name()} (profile {target.profile_key()}.json)")
        if a.quick:
            study = _run_quick(target, settings, run, a)
        else:
            study = run_tune(target, settings, run, a.storage, a.study_name)
        print(results_table(study))
        export = a.export or (str(Environment.read().user_profile_dir) if a.quick else None)
        if export:
            _export(study, target, Path(export), None, a)
        print(f"louver-tune tune: {time.monotonic() - started:.0f} s in all")
        return 0


def _run_quick(target, settings: TuneSettings, run: RunOptions, a: argparse.Namespace):
    """The quick study: seeded from the nearest profile, in its narrowed space (``louver_tuning.quick``)."""
    from .study import default_trace_loader

    if settings.space != "quick":
        raise ValueError("--quick searches its own narrowed space; drop --space")
    first = default_trace_loader(settings.text, parse_case(settings.cases[0])[0])
    selection, seed = nearest_seed(target, settings, first["meta"])
    print(f"quick: seeded from {selection.kind} profile: {selection.message}")
    space = quick_space(target.launch_space(), seed)
    return run_tune(target, settings, run, a.storage or "memory:", a.study_name, space=space,
                    seeds=[(seed, "nearest")])


class Show:
    help = "best trials and parameter importances of a study"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        _study_args(p)
        p.add_argument("--top", type=int, default=10)

    def take_action(self, a: argparse.Namespace) -> int:
        study = open_study(a.storage, _study_name(a), create=False)
        print(results_table(study, a.top))
        for name, value in importances(study).items():
            print(f"  importance {name:26} {value:.3f}")
        return 0


class Export:
    help = "write the best trial of a study as a profile (plots beside it)"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        _study_args(p)
        p.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help="directory of <device key>.json")
        p.add_argument("--out", help="exact output file (overrides --out-dir)")
        _report_args(p)
        _confirm_args(p)
        _replace_arg(p)

    def take_action(self, a: argparse.Namespace) -> int:
        study = open_study(a.storage, _study_name(a), create=False)
        settings = study.user_attrs["settings"]
        target = get_target(study.user_attrs["target"], settings["repeats"], settings["warmup"])
        _export(study, target, Path(a.out_dir), Path(a.out) if a.out else None, a)
        return 0


class List:
    help = "profiles shipped with louver-sgl and found in LOUVER_PROFILE_DIR (and studies in --storage)"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--storage", help="also list the studies in this storage")

    def take_action(self, a: argparse.Namespace) -> int:
        for path in find_profiles():
            try:
                prof = Profile.load(path)
                s = prof.shapes
                print(f"{path}: {prof.target} {prof.device_name!r} louver {prof.louver_version} "
                      f"D={s.head_dim} H_q={s.num_q_heads} H_kv={s.num_kv_heads} {s.kv_dtype}")
            except ProfileError as exc:
                print(f"{path}: INVALID ({exc})")
        if a.storage:
            import optuna

            from .storage import open_storage

            for summary in optuna.get_all_study_summaries(open_storage(a.storage)):
                print(f"study {summary.study_name}: {summary.n_trials} trials")
        return 0


def _study_name(a: argparse.Namespace) -> str:
    if a.study_name:
        return a.study_name
    import optuna

    from .storage import open_storage

    names = optuna.get_all_study_names(open_storage(a.storage))
    if len(names) != 1:
        raise SystemExit(f"--study-name is required: {a.storage} holds {len(names)} studies {names}")
    return names[0]


def _report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--report-dir", metavar="DIR",
                   help="where the study's plots and results table go (default: beside the profile; the "
                        "shipped profiles' reports live in tuning/reports, out of the package data)")


def _confirm_args(p: argparse.ArgumentParser, quick: tuple[int, int] | None = None) -> None:
    extra = f"; --quick {quick[0]}" if quick else ""
    p.add_argument("--confirm-top", type=int, help="re-time this many best trials and the baseline (defaults, or "
                                                   f"the nearest profile) interleaved before exporting (0: off; default 5{extra})")
    p.add_argument("--confirm-rounds", type=int, help=f"(default 3{'; --quick ' + str(quick[1]) if quick else ''})")


def _replace_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replace", action="store_true",
                   help="overwrite the device's profile file whole; by default a study under another policy than "
                        "the file's becomes that policy's section of it (docs/tuning.md, \"Per-policy sections\")")


def _export(study, target, out_dir: Path, out: Path | None, a: argparse.Namespace) -> None:
    launch_names = set(target.launch_space())
    confirmation = None
    quick = getattr(a, "quick", False)
    top = a.confirm_top if a.confirm_top is not None else (QUICK_CONFIRM[0] if quick else 5)
    rounds = a.confirm_rounds if a.confirm_rounds is not None else (QUICK_CONFIRM[1] if quick else 3)
    if top > 0:
        from .confirm import confirm_best

        confirmation = confirm_best(study, target, launch_names, top, rounds)
    tuned = study_profile(study, launch_names, confirmation)
    name = profile_file_name(profile_key(tuned.target, tuned.device_name), tuned.shapes.kv_dtype)
    path, section = _write_merged(tuned, Path(out or out_dir / name), getattr(a, "replace", False))
    stem = (Path(a.report_dir) / path.stem) if a.report_dir else path.with_suffix("")
    if section:  # a section's reports beside, not over, those of the main values' study
        stem = stem.with_name(f"{stem.name}.{section}")
    stem.parent.mkdir(parents=True, exist_ok=True)
    plots = write_plots(study, stem)
    stem.with_name(stem.name + ".results.txt").write_text(results_table(study, top=20) + "\n")
    print(f"profile {path}{f' (its {section!r} section)' if section else ''}; plots {[str(p) for p in plots]}")
    gains = {k: v for k, v in tuned.measured.items() if k.startswith("speedup_vs_")}
    print(json.dumps({"config": dict(tuned.config), "launch": dict(tuned.launch), **gains}, indent=1))


def _write_merged(tuned: Profile, path: Path, replace: bool) -> tuple[Path, str | None]:
    """Write ``tuned`` to ``path``, as a section of the profile there when it was tuned under
    another policy (``merge_tuned``); returns the path and the section's policy (None: main values)."""
    existing = None
    if path.is_file() and not replace:
        try:
            existing = Profile.load(path)
        except ProfileError as exc:
            print(f"[louver-tune] {path}: replacing an unreadable profile ({exc})")
    profile, done = merge_tuned(existing, tuned)
    path = profile.write(path)
    print(f"[louver-tune] {path}: {done}")
    return path, (tuned.shapes_policy if profile.shapes_policy != tuned.shapes_policy else None)


class Generic:
    help = "derive the generic profiles (one per ISA and per target) from a directory of tuned ones"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        from louver_sgl.profiles import GENERIC_DIR, SHIPPED_DIR

        p.add_argument("--tuned-dir", default=str(SHIPPED_DIR), help="tuned profiles (default: the shipped ones)")
        p.add_argument("--out-dir", default=str(GENERIC_DIR), help="where the generic profiles go (default: shipped)")

    def take_action(self, a: argparse.Namespace) -> int:
        from louver_sgl.profiles.generic import write_generic_profiles

        for path in write_generic_profiles(Path(a.tuned_dir), Path(a.out_dir)):
            prof = Profile.load(path)
            print(f"{path}: config {dict(prof.config)} launch {dict(prof.launch)}")
        return 0


COMMANDS = {"tune": Tune, "show": Show, "export": Export, "list": List, "generic": Generic}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="louver-tune", description="Tune louver-sgl per device (Optuna).")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, cls in COMMANDS.items():
        cmd = cls()
        p = sub.add_parser(name, help=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(handler=cmd)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        return args.handler.take_action(args)
    except ValueError as exc:  # ProfileError included
        parser.exit(2, f"louver-tune {args.command}: error: {exc}\n")
