"""``louver-tune tune --quick``: a profile for a machine without one, in minutes.

What makes it quick, against the full study (``docs/tuning.md``, "--quick"):

* **seeded**: the first trial is the nearest profile the backend would run here today
  (``profiles.select``: this device's for another dtype, else the generic profile of its ISA);
* **narrowed**: the grid family only (the compiled kernels' codes), the seed's page size and its
  neighbours, 4- or 8-bit codes, sink/recent pages within one of the seed's, chunk sizes within
  4x of the seed's, every core's thread count; the dtype-dependent dispatch knobs keep the seed's
  values (the short workload cannot see the dense crossover);
* **short workloads**: 16K-token traces at batch 1 and 4, three timed runs per point;
* **early pruning**: a trial stops at the first case more than 1.5x the best trial's;
* **time-boxed**: 4 minutes of trials, then the best three and the seed re-timed in two
  interleaved rounds, and the winner written where the backend looks at its next start
  (``Environment.user_profile_dir``).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

import louver_sgl
from louver_sgl import LouverConfig
from louver_sgl.profiles import Selection, Shapes, select_profile
from louver_sgl.profiles.format import DTYPE_DEPENDENT

from .space import SearchSpace, build_space, contains
from .study import RunOptions, TuneSettings

QUICK_SETTINGS = TuneSettings(cases=("16384x1", "16384x4"), space="quick", repeats=3, warmup=1)
QUICK_RUN = RunOptions(trials=200, timeout=240.0, prune_ratio=1.5)
QUICK_CONFIRM = (3, 2)  # (best trials re-timed, rounds)
PAGE_SIZES = (32, 64, 128)


def nearest_seed(target, settings: TuneSettings, trace_meta: Mapping[str, Any]) -> tuple[Selection, dict[str, Any]]:
    """The profile the backend would run here for the traces' shapes, and its point in the search
    space (a generic profile's ``num_threads`` 0 becomes this machine's count, as the server runs it)."""
    shapes = Shapes(int(trace_meta["head_dim"]), int(trace_meta["num_heads"]), int(trace_meta["num_kv_heads"]),
                    settings.kv_dtype)
    selection = select_profile(target.name, shapes, louver_sgl.__version__)
    base = LouverConfig()
    profile = selection.profile.for_policy(settings.policy) if selection.profile else None  # as a server of it runs
    config = dict(profile.config) if profile else {}
    point = {name: config.get(name, getattr(base, name)) for name in
             ("page_size", "grid_bits", "sink_pages", "recent_pages", *DTYPE_DEPENDENT)}
    point["family"] = "grid"
    launch = {**target.default_launch(), **(dict(profile.launch) if profile else {})}
    if not launch.get("num_threads"):
        launch["num_threads"] = torch.get_num_threads()
    return selection, {**point, **launch}


def quick_space(launch_space: Mapping, seed: Mapping[str, Any]) -> SearchSpace:
    """The narrowed space around ``seed`` (module docstring); every seed value is a point of it."""
    space = build_space(launch_space, 1 << 30, "full")
    page = seed["page_size"]
    pages = [p for p in PAGE_SIZES if page // 2 <= p <= page * 2] or [page]
    near = lambda v, lo, hi: sorted({min(max(v + d, lo), hi) for d in (-1, 0, 1)})  # noqa: E731
    choices: dict[str, list] = {
        "family": ["grid"], "page_size": pages, "grid_bits": sorted({4, 8, seed["grid_bits"]}),
        "sink_pages": near(seed["sink_pages"], 0, 4), "recent_pages": near(seed["recent_pages"], 0, 4),
        **{k: [seed[k]] for k in DTYPE_DEPENDENT},
    }
    for name, dist in launch_space.items():
        values = list(getattr(dist, "choices", []))
        if name == "chunk_pages":
            values = [v for v in values if seed[name] / 4 <= v <= seed[name] * 4]
        elif name == "num_threads":
            values = sorted({max(values), seed[name]})
        choices[name] = values if contains(dist, seed[name]) else values + [seed[name]]
    return space.restrict(choices)
