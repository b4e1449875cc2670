"""``louver-tune`` (also ``python -m louver_tuning``): tune, show, export, list.

One command class per subcommand with ``add_arguments`` and ``take_action`` (Optuna's CLI layout).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from louver_sgl.profiles import Profile, ProfileError, find_profiles, profile_key
from louver_sgl.profiles.select import profile_file_name
from louver_sgl.settings import Environment

from .report import importances, results_table, write_plots
from .storage import DEFAULT_STORAGE
from .study import RunOptions, TuneSettings, open_study, run_tune, study_profile
from .targets import get_target

DEFAULT_OUT_DIR = "louver-profiles"


def _study_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--storage", default=Environment.read().tune_storage or DEFAULT_STORAGE,
                        help="RDB URL (sqlite:///f.db, postgresql://...) or journal:PATH (default %(default)s)")
    parser.add_argument("--study-name", help="default: <device key>-<shapes>-<policy>-<space>")


class Tune:
    help = "run or resume a study for a target"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        _study_args(p)
        d = TuneSettings()
        p.add_argument("--target", default="auto", help="auto, cpu or a registered target")
        p.add_argument("--cases", nargs="+", default=list(d.cases), help="LENGTHxBATCH, e.g. 8192x8")
        p.add_argument("--text", default=d.text)
        p.add_argument("--layers", type=int, nargs="+", default=list(d.layers))
        p.add_argument("--validation", nargs="+", default=list(d.validation), help="LENGTHxBATCH of the validation set")
        p.add_argument("--validation-text", default=d.validation_text)
        p.add_argument("--policy", default=d.policy, choices=["certified", "budget", "fixed", "dense"])
        p.add_argument("--eps", type=float, default=d.eps)
        p.add_argument("--kv-dtype", default=d.kv_dtype, choices=["float16", "bfloat16", "float32"])
        p.add_argument("--space", default=d.space, choices=["full", "small"])
        p.add_argument("--repeats", type=int, default=d.repeats)
        p.add_argument("--warmup", type=int, default=d.warmup)
        r = RunOptions()
        p.add_argument("--trials", type=int, default=r.trials, help="trials to add in this run")
        p.add_argument("--timeout", type=float, default=None, help="seconds for this run")
        p.add_argument("--sampler", default=r.sampler, choices=["tpe", "random", "grid"])
        p.add_argument("--seed", type=int, default=r.seed)
        p.add_argument("--prune-ratio", type=float, default=r.prune_ratio,
                       help="prune a trial whose case latency exceeds this x the best trial's")
        p.add_argument("--export", metavar="DIR", help="export the profile (and plots) into DIR afterwards")
        _report_args(p)
        _confirm_args(p)

    def take_action(self, a: argparse.Namespace) -> int:
        settings = TuneSettings(tuple(a.cases), a.text, tuple(a.layers), tuple(a.validation), a.validation_text,
                                a.policy, a.eps, a.kv_dtype, a.space, a.repeats, a.warmup)
        target = get_target(a.target, a.repeats, a.warmup)
        print(f"target {target.name}: {target.device_name()} (profile {target.profile_key()}.json)")
        study = run_tune(target, settings, RunOptions(a.trials, a.timeout, a.sampler, a.seed, a.prune_ratio),
                         a.storage, a.study_name)
        print(results_table(study))
        if a.export:
            _export(study, target, Path(a.export), None, a)
        return 0


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


def _confirm_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--confirm-top", type=int, default=5,
                   help="re-time this many best trials and the defaults interleaved before exporting (0: off)")
    p.add_argument("--confirm-rounds", type=int, default=3)


def _export(study, target, out_dir: Path, out: Path | None, a: argparse.Namespace) -> None:
    launch_names = set(target.launch_space())
    confirmation = None
    if a.confirm_top > 0:
        from .confirm import confirm_best

        confirmation = confirm_best(study, target, launch_names, a.confirm_top, a.confirm_rounds)
    profile = study_profile(study, launch_names, confirmation)
    name = profile_file_name(profile_key(profile.target, profile.device_name), profile.shapes.kv_dtype)
    path = profile.write(out or out_dir / name)
    stem = (Path(a.report_dir) / path.stem) if a.report_dir else path.with_suffix("")
    stem.parent.mkdir(parents=True, exist_ok=True)
    plots = write_plots(study, stem)
    stem.with_name(stem.name + ".results.txt").write_text(results_table(study, top=20) + "\n")
    print(f"profile {path}; plots {[str(p) for p in plots]}")
    print(json.dumps({"config": dict(profile.config), "launch": dict(profile.launch),
                      "speedup_vs_defaults": profile.measured.get("speedup_vs_defaults")}, indent=1))


COMMANDS = {"tune": Tune, "show": Show, "export": Export, "list": List}


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
