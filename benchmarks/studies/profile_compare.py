"""Two profiles' decode steps timed back to back: e.g. ``tune --quick``'s against a full study's.

For each accuracy setting, every profile's point (its config and launch as a server of the
setting's policy uses them: with the profile's section for that policy, if any; ``NAME=PATH@POLICY``
takes the values a server of POLICY would use instead, e.g. ``@certified`` for a certified-tuned
profile's main values) is timed on the same cases with the CPU target's wall-clock timer, interleaved
round-robin over rounds, cases and profiles (``louver_tuning.confirm.time_points``); the per-case
latency is the median over rounds of the mean over layers.

    python -m benchmarks.studies.profile_compare --profiles full=louver_sgl/profiles/X.float32.json \\
        quick=~/.local/share/louver_sgl/profiles/X.float32.json --kv-dtype float32 \\
        --out benchmarks/results/tune_quick_vs_full.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from louver_sgl.profiles import Profile
from louver_tuning.confirm import time_points
from louver_tuning.cpu import CpuTarget
from louver_tuning.study import TuneSettings

from benchmarks.record import write_result

POLICIES = {"budget-0.05": ("budget", {"budget": 0.05}), "certified-1e-2": ("certified", {"eps": 1e-2}),
            "certified-1e-3": ("certified", {"eps": 1e-3})}


def point(profile: Profile, policy: str, accuracy: dict) -> tuple[dict, dict]:
    """(config overrides, launch) of ``profile`` as a server of ``policy`` runs it, under
    ``accuracy`` (threads 0: this machine's)."""
    profile = profile.for_policy(policy)
    launch = dict(profile.launch)
    if not launch.get("num_threads"):
        launch["num_threads"] = torch.get_num_threads()
    return {**profile.config, **accuracy}, launch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", nargs="+", required=True, help="NAME=PATH of each profile")
    parser.add_argument("--cases", nargs="+", default=["32768x1", "32768x8"])
    parser.add_argument("--layers", type=int, nargs="+", default=[9, 21])
    parser.add_argument("--policies", nargs="+", default=["budget-0.05", "certified-1e-2"], choices=sorted(POLICIES))
    parser.add_argument("--kv-dtype", default="float32", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    profiles, sections = {}, {}
    for spec in args.profiles:
        name, path = spec.split("=", 1)
        path, _, section = path.partition("@")
        profiles[name], sections[name] = Profile.load(Path(path).expanduser()), section or None
    rows = []
    for policy in args.policies:
        kind, accuracy = POLICIES[policy]
        settings = TuneSettings(cases=tuple(args.cases), layers=tuple(args.layers), policy=kind,
                                eps=accuracy.get("eps", 1e-3), kv_dtype=args.kv_dtype, repeats=args.repeats)
        points = {name: point(p, sections[name] or kind, accuracy) for name, p in profiles.items()}
        timed = time_points(CpuTarget(args.repeats, 1), settings, points, args.rounds)
        for case in args.cases:
            row = {"policy": policy, "case": case, **{f"{n}_ms": timed[n]["case_ms"][case] for n in profiles}}
            first, *others = profiles
            for other in others:
                row[f"{other}_vs_{first}"] = row[f"{other}_ms"] / row[f"{first}_ms"]
            rows.append(row)
            print(row, flush=True)
    write_result(args.out, {"machine": {"device": CpuTarget().device_name(), "threads": torch.get_num_threads()},
                            "profiles": {n: {"path": str(p.path), "section": sections[n], "config": dict(p.config),
                                             "launch": dict(p.launch), "policies": dict(p.policies)}
                                         for n, p in profiles.items()},
                            "settings": {"cases": args.cases, "layers": args.layers, "kv_dtype": args.kv_dtype,
                                         "rounds": args.rounds, "repeats": args.repeats},
                            "rows": rows})


if __name__ == "__main__":
    main()
