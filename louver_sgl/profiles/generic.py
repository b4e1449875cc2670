"""Generic profiles: what a device without a tuned profile of its own runs.

A generic profile is derived from the tuned profiles of one instruction set (``cpu_avx512``,
``cpu_avx2``, ``cuda_sm90``), or of a whole target where no tuned profile of that ISA exists
(``cpu``, ``cuda``). They ship in ``profiles/generic/`` and are the backend's built-in defaults
(``LouverConfig()``'s plain values run only with ``LOUVER_PROFILE=none``). The rule, knob by knob
(``derive_generic``):

* index layout and kernel launch: the value most of the tuned profiles chose; a tie goes to the
  profile that gained most over the plain defaults in its own same-run re-timing
  (``measured.speedup_vs_defaults``);
* ``num_threads``: 0, the machine's own thread count (machines of one ISA differ in cores);
* ``min_sparse_tokens``: the largest any of them chose (the sparse path only where every tuned
  machine found it faster than dense attention);
* ``dense_fallback_fraction``: the largest (a fallback adds a dense step to the sparse one).

A tuned profile that does not name a ``LouverConfig`` field or a CPU launch field
(``ServingOptions``) ran with its default, so it counts with that value: a knob that only later
studies searched (``certified_passes``, ``one_scan``) does not take one study's choice for every
machine.

``louver-tune generic`` rewrites the shipped generic files from the shipped tuned profiles, and a
test holds the shipped files equal to what this rule derives.
"""

from __future__ import annotations

import json

from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Sequence

from .format import Profile, ProfileError

GENERIC_DIR = Path(__file__).parent / "generic"
LARGEST = ("min_sparse_tokens", "dense_fallback_fraction")  # the conservative end of each
MACHINE_THREADS = {"num_threads": 0}  # launch values that belong to the machine, not the ISA


def generic_key(target: str, isa: str | None = None) -> str:
    """File stem of the generic profile of ``isa`` on ``target`` (``cpu_avx512``), or of the
    whole target (``cpu``) when ``isa`` is None."""
    return f"{target}_{isa}" if isa else target


def derive_generic(profiles: Iterable[Profile], target: str, isa: str | None = None) -> Profile | None:
    """The generic profile of ``isa`` (None: every ISA of ``target``) from the tuned ``profiles``
    (see the module docstring for the rule); None when no tuned profile qualifies."""
    sources = sorted((p for p in profiles if p.target == target and not p.generic and (isa is None or p.isa == isa)),
                     key=lambda p: (-_gain(p), p.device_name, p.kv_dtype or ""))
    if not sources:
        return None
    config = {name: _choose(name, [_value(p.config, name, _config_default) for p in sources
                                   if name in p.config or _config_default(name) is not _NONE])
              for name in _names(p.config for p in sources)}
    launch = {name: MACHINE_THREADS.get(name, _choose(name, [_value(p.launch, name, _launch_default) for p in sources
                                                             if name in p.launch or _launch_default(name) is not _NONE]))
              for name in _names(p.launch for p in sources)}
    versions = Counter(p.louver_version for p in sources)
    measured = {"rule": "profiles.generic.derive_generic",
                "derived_from": [f"{p.device_name} {p.kv_dtype}" for p in sources]}
    return Profile(target, f"generic {isa or target}", versions.most_common(1)[0][0], config, launch, None,
                   measured, isa=isa, generic=True)


_NONE = object()  # no default: a profile without the knob does not count


def _config_default(name: str) -> Any:
    from ..config import LouverConfig

    return getattr(LouverConfig(), name, _NONE)


def _launch_default(name: str) -> Any:
    """The ``ServingOptions`` default of a CPU launch field (a CUDA profile's Triton fields and
    dispatch rules have none here: only the profiles that name them count)."""
    from ..settings import ServingOptions

    return getattr(ServingOptions(), name, _NONE) if name in CPU_LAUNCH else _NONE


CPU_LAUNCH = ("chunk_pages", "num_threads", "one_scan", "residual_weights")


def _value(section: dict, name: str, default) -> Any:
    return section[name] if name in section else default(name)


def _gain(profile: Profile) -> float:
    gain = profile.measured.get("speedup_vs_defaults") if isinstance(profile.measured, dict) else None
    return float(gain) if isinstance(gain, (int, float)) else 0.0


def _names(dicts: Iterable[dict]) -> list[str]:
    names: list[str] = []
    for d in dicts:
        names += [n for n in d if n not in names]
    return names


def _choose(name: str, values: Sequence[Any]) -> Any:
    """``values`` are in the sources' order (largest gain first): the most common one, a tie
    going to the earliest; the largest for the knobs of ``LARGEST``."""
    if name in LARGEST:
        return max(values)
    key = lambda v: json.dumps(v, sort_keys=True)  # noqa: E731  (objects and lists count by content)
    counts = Counter(key(v) for v in values)
    top = max(counts.values())
    return next(v for v in values if counts[key(v)] == top)


def generic_profiles(tuned: Sequence[Profile]) -> dict[str, Profile]:
    """Every generic profile the ``tuned`` ones give: one per (target, ISA), one per target."""
    out: dict[str, Profile] = {}
    for target in sorted({p.target for p in tuned}):
        for isa in sorted({p.isa for p in tuned if p.target == target and p.isa}):
            out[generic_key(target, isa)] = derive_generic(tuned, target, isa)
        out[generic_key(target)] = derive_generic(tuned, target)
    return out


def write_generic_profiles(tuned_dir: Path, out_dir: Path = GENERIC_DIR) -> list[Path]:
    """Derive the generic profiles from the tuned profiles in ``tuned_dir`` into ``out_dir``."""
    tuned = [Profile.load(p) for p in sorted(Path(tuned_dir).glob("*.json"))]
    return [profile.write(Path(out_dir) / f"{key}.json") for key, profile in generic_profiles(tuned).items()]


def load_generic(target: str, isa: str | None, directory: Path = GENERIC_DIR) -> Profile | None:
    """The shipped generic profile of ``isa`` on ``target``, else of the whole target, else None."""
    for key in ([generic_key(target, isa)] if isa else []) + [generic_key(target)]:
        path = Path(directory) / f"{key}.json"
        if path.is_file():
            profile = Profile.load(path)
            if not profile.generic:
                raise ProfileError(f"{path}: a file of the generic profiles is not generic")
            return profile
    return None
