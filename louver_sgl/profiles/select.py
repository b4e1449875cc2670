"""Which profile applies at startup, and why (the nearest-match rule).

``LOUVER_PROFILE`` names a profile file (or ``none`` for ``LouverConfig``'s plain defaults). A
profile the user names explicitly must apply: a corrupt file or one tuned for another device kind,
louver version or attention shape raises ``ProfileError`` at startup. Without it, the nearest
profile applies, searched in ``LOUVER_PROFILE_DIR`` (if set), then the user profile directory
(where ``louver-tune tune --quick`` writes), then among the profiles shipped in this package:

1. **exact**: a profile of this device (file ``<device key>.<dtype>.json`` or ``<device key>.json``)
   tuned for the served attention shapes and KV dtype;
2. **this device, another dtype**: a profile of this device tuned for the same attention shapes
   in another KV dtype. Its index layout and launch values apply; the knobs that move with the
   dtype (``format.DTYPE_DEPENDENT``: where sparse beats dense, when to fall back) come from the
   generic profile of the ISA;
3. **generic**: the generic profile of this ISA, else of the target (``profiles.generic``),
   derived from the tuned profiles. It is what the backend calls its built-in defaults.

The log line names the profile, the level and why the nearer ones did not apply; below level 1 it
also names the command that tunes this machine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Mapping

from ..settings import Environment
from .device import device_isa, device_name, profile_key
from .format import DTYPE_DEPENDENT, KV_DTYPES, Profile, ProfileError, Shapes
from .generic import GENERIC_DIR, load_generic

PROFILE_ENV = "LOUVER_PROFILE"
PROFILE_DIR_ENV = "LOUVER_PROFILE_DIR"
SHIPPED_DIR = Path(__file__).parent
DISABLED = ("none", "off", "defaults")
KINDS = ("explicit", "exact", "other_dtype", "generic", "none")
Accept = Callable[[Profile], None]  # raises ValueError when a profile's values cannot serve here


@dataclass(frozen=True)
class Selection:
    """The profile in use (None: ``LouverConfig``'s plain defaults), how near it is (one of
    ``KINDS``) and the one log line that says which and why."""

    profile: Profile | None
    message: str
    kind: str = "exact"


def search_dirs(environ: Mapping[str, str] | None = None) -> list[Path]:
    """Directories searched for ``<device key>.json``, highest priority first."""
    env = Environment.read(environ)
    return ([Path(env.profile_dir)] if env.profile_dir else []) + [env.user_profile_dir, SHIPPED_DIR]


def find_profiles(environ: Mapping[str, str] | None = None) -> list[Path]:
    """Every ``*.json`` profile file in the search directories."""
    return [p for d in search_dirs(environ) if d.is_dir() for p in sorted(d.glob("*.json"))]


def profile_file_names(key: str, kv_dtype: str) -> list[str]:
    """The file names a device's profile for a KV dtype may have, first choice first: one tuned
    for that dtype (``<key>.<dtype>.json``), then the device's main one (``<key>.json``, fp16 or
    whatever it was tuned for; its shapes decide whether it applies)."""
    return [f"{key}.{kv_dtype}.json", f"{key}.json"]


def profile_file_name(key: str, kv_dtype: str) -> str:
    """Where ``louver-tune export`` writes a profile: fp16 ones keep the device's main name."""
    return f"{key}.json" if kv_dtype == "float16" else f"{key}.{kv_dtype}.json"


def tune_command(kv_dtype: str) -> str:
    """The command that gives this machine a profile of its own for ``kv_dtype`` KV."""
    return f"louver-tune tune --quick --kv-dtype {kv_dtype}"


def select_profile(target: str, shapes: Shapes, version: str, environ: Mapping[str, str] | None = None,
                   raw_device_name: str | None = None, isa: str | None = None,
                   accept: Accept | None = None) -> Selection:
    """The nearest profile for this device and model (module docstring); raises
    ``ProfileError`` only for an explicit one. ``isa`` defaults to this machine's (for a CPU
    ``raw_device_name``, its last word); ``accept`` rejects profiles whose values cannot serve."""
    explicit = (Environment.read(environ).profile or "").strip()
    if explicit.lower() in DISABLED:
        return Selection(None, f"louver: {PROFILE_ENV}={explicit}: using LouverConfig's plain defaults (no profile)",
                         "none")
    if explicit:
        profile = Profile.load(explicit)
        profile.check_compatible(target, shapes, version)
        return Selection(profile, f"louver: using profile {explicit} ({PROFILE_ENV}; tuned on {profile.device_name})",
                         "explicit")
    raw = raw_device_name or device_name(target)
    isa = isa or (raw.split()[-1].lower() if target == "cpu" else device_isa(target))  # CPU names end in it
    candidates, rejected = _device_profiles(profile_key(target, raw), shapes, target, version, environ, accept)
    exact = next((p for p in candidates if p.kv_dtype == shapes.kv_dtype), None)
    if exact is not None:
        return Selection(exact, f"louver: using tuned profile {exact.path} (tuned for this device, "
                                f"{shapes.kv_dtype} KV)", "exact")
    generic = load_generic(target, isa)
    why = f"no tuned profile for {raw!r} with {shapes.kv_dtype} KV" + (f" ({'; '.join(rejected)})" if rejected else "")
    hint = f"tune one for this machine in about 10 minutes: {tune_command(shapes.kv_dtype)}"
    if candidates and generic is not None:
        return _other_dtype(candidates[0], generic, shapes, why, hint)
    if generic is not None:
        return Selection(generic, f"louver: using the generic {generic.isa or target} profile {generic.path}, derived "
                                  f"from the tuned ones ({why}); {hint}", "generic")
    return Selection(None, f"louver: {why} and no generic profile for {target} {isa} in {GENERIC_DIR}; using "
                           f"LouverConfig's plain defaults; {hint}", "none")


def _other_dtype(device: Profile, generic: Profile, shapes: Shapes, why: str, hint: str) -> Selection:
    """This device's profile for another KV dtype, with the dtype-dependent knobs of ``generic``."""
    knobs = {k: generic.config[k] for k in DTYPE_DEPENDENT if k in generic.config}
    def layout(config):  # what stays of a config tuned in the other dtype (the rest: plain defaults)
        return {k: v for k, v in config.items() if k not in DTYPE_DEPENDENT}

    policies = {name: {**section, "config": layout(section.get("config", {}))}
                for name, section in device.policies.items()}
    profile = replace(device, config={**layout(device.config), **knobs}, policies=policies)
    message = (f"louver: using tuned profile {device.path} of this device for {device.kv_dtype} KV ({why}): its index "
               f"layout and launch, with {', '.join(f'{k}={v}' for k, v in knobs.items()) or 'nothing'} from the "
               f"generic {generic.isa} profile (those depend on the dense path's speed in each dtype); {hint}")
    return Selection(profile, message, "other_dtype")


def _device_profiles(key: str, shapes: Shapes, target: str, version: str, environ, accept: Accept | None
                     ) -> tuple[list[Profile], list[str]]:
    """This device's valid profiles for the served attention shapes in any KV dtype (the served
    dtype's file first in each directory, directories in priority order), and why others were not."""
    names = profile_file_names(key, shapes.kv_dtype) + [f"{key}.{d}.json" for d in KV_DTYPES if d != shapes.kv_dtype]
    found, rejected = [], []
    for path in (d / n for d in search_dirs(environ) for n in names):
        if not path.is_file():
            continue
        try:
            profile = Profile.load(path)
            if profile.generic:  # no shapes to hold against the served ones: not this device's tuned profile
                raise ProfileError(f"profile {path} does not apply: it is a generic profile (\"generic\": true, "
                                   "no shapes) under a device profile's file name")
            problems = profile.version_problems(target, version) + [
                m for m in profile.shapes.mismatches(shapes) if not m.startswith("kv_dtype")]
            if problems:
                raise ProfileError(f"profile {path} does not apply: " + "; ".join(problems))
            if accept is not None:
                accept(profile)
        except (ProfileError, ValueError, TypeError) as exc:
            rejected.append(str(exc))
            continue
        found.append(profile)
    return found, rejected
