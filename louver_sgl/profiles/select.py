"""Which profile applies at startup.

``LOUVER_PROFILE`` names a profile file (or ``none`` for the built-in defaults). A profile the user
names explicitly must apply: a corrupt file or one tuned for another device kind, louver version
or attention shape raises ``ProfileError`` at startup. Without it, the profile whose file name is
this device's key is looked up in ``LOUVER_PROFILE_DIR`` (if set) and then among the profiles
shipped in this package; a missing, corrupt or mismatched one is reported in the log line and the
defaults are used, so a server on new hardware or a new model still starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ..settings import Environment
from .device import device_name, profile_key
from .format import Profile, ProfileError, Shapes

PROFILE_ENV = "LOUVER_PROFILE"
PROFILE_DIR_ENV = "LOUVER_PROFILE_DIR"
SHIPPED_DIR = Path(__file__).parent
DISABLED = ("none", "off", "defaults")


@dataclass(frozen=True)
class Selection:
    """The profile in use (None: built-in defaults) and the one log line that says why."""

    profile: Profile | None
    message: str


def search_dirs(environ: Mapping[str, str] | None = None) -> list[Path]:
    """Directories searched for ``<device key>.json``, highest priority first."""
    user = Environment.read(environ).profile_dir
    return ([Path(user)] if user else []) + [SHIPPED_DIR]


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


def select_profile(target: str, shapes: Shapes, version: str, environ: Mapping[str, str] | None = None,
                   raw_device_name: str | None = None) -> Selection:
    """The profile for this device and model; raises ``ProfileError`` only for an explicit one."""
    explicit = (Environment.read(environ).profile or "").strip()
    if explicit.lower() in DISABLED:
        return Selection(None, f"louver: {PROFILE_ENV}={explicit}: using the built-in defaults")
    if explicit:
        profile = Profile.load(explicit)
        profile.check_compatible(target, shapes, version)
        return Selection(profile, f"louver: using profile {explicit} ({PROFILE_ENV}; tuned on {profile.device_name})")
    raw = raw_device_name or device_name(target)
    key = profile_key(target, raw)
    names = profile_file_names(key, shapes.kv_dtype)
    path = next((d / n for d in search_dirs(environ) for n in names if (d / n).is_file()), None)
    if path is None:
        return Selection(None, f"louver: no tuned profile for {raw!r} ({' or '.join(names)}); using the "
                               "built-in defaults")
    try:
        profile = Profile.load(path)
        profile.check_compatible(target, shapes, version)
    except ProfileError as exc:
        return Selection(None, f"louver: {exc}; using the built-in defaults")
    return Selection(profile, f"louver: using tuned profile {path}")
