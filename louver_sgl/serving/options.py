"""Backend options from a JSON file and ``LOUVER_*`` environment variables.

SGLang has no plugin CLI flags, and environment variables reach every scheduler subprocess, so
options come from (lowest to highest priority): the defaults, the tuned profile of the device
(``louver_sgl.profiles``: its ``config`` and ``launch`` values, with those of its section for the
served policy over them when it has one), the JSON file named by
``LOUVER_CONFIG``, then one ``LOUVER_<OPTION>`` variable per option (``LOUVER_EPS=1e-3``,
``LOUVER_POLICY=budget``, ...). Every ``LouverConfig`` field is an option, plus the serving
options of ``ServingOptions``. Invalid values fail at startup with a message naming the option.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Mapping

from ..config import LouverConfig
from ..profiles import PROFILE_ENV, Profile, ProfileError, Selection, Shapes, select_profile
from ..settings import ENV_PREFIX, OPTION_FIELDS, Environment, ServingOptions  # noqa: F401 (re-exported)

_CONFIG_KEYS = frozenset(f.name for f in dataclasses.fields(LouverConfig))
CONFIG_FILE_ENV = "LOUVER_CONFIG"


def load_options(environ: Mapping[str, str] | None = None,
                 profile: Profile | None = None) -> tuple[LouverConfig, ServingOptions]:
    """Resolve the backend options; raises ``ValueError`` naming the bad option or file."""
    env = Environment.read(environ)
    user: dict[str, Any] = _read_json(Path(env.config_file)) if env.config_file else {}
    for name, raw in env.options.items():
        user[name] = _parse(name, raw, OPTION_FIELDS[name].default)
    values: dict[str, Any] = {}
    if profile is not None:  # the section tuned under the served policy, if the profile has one
        values = profile_values(profile.for_policy(served_policy(user)))
    values.update(user)
    config_keys = {f.name for f in dataclasses.fields(LouverConfig)}
    serving_keys = {f.name for f in dataclasses.fields(ServingOptions)}
    unknown = sorted(set(values) - config_keys - serving_keys)
    if unknown:
        raise ValueError(f"unknown louver options {unknown}; known: {sorted(config_keys | serving_keys)}")
    config = LouverConfig(**{k: v for k, v in values.items() if k in config_keys})
    serving = ServingOptions(**{k: v for k, v in values.items() if k in serving_keys})
    return config, serving


def resolve_options(target: str, shapes: Shapes, environ: Mapping[str, str] | None = None,
                    raw_device_name: str | None = None, isa: str | None = None
                    ) -> tuple[LouverConfig, ServingOptions, Selection]:
    """Options on top of the nearest profile (see ``louver_sgl.profiles.select``).

    A profile named by ``LOUVER_PROFILE`` must apply (``ProfileError`` otherwise); an auto-picked
    one whose values are invalid here is named in the selection message and the next nearest applies.
    """
    from .. import __version__

    environ = os.environ if environ is None else environ
    selection = select_profile(target, shapes, __version__, environ, raw_device_name, isa, accept=check_values)
    if selection.profile is not None:  # an explicit or generic one was not checked by ``accept``
        try:
            check_values(selection.profile)
        except (TypeError, ValueError) as exc:
            raise ProfileError(f"{PROFILE_ENV}: {exc} ({selection.message})") from exc
    config, serving = load_options(environ, selection.profile)
    if selection.profile is not None and selection.profile.section(config.policy) is not None:
        selection = dataclasses.replace(selection, message=(
            f"{selection.message}; with its {config.policy!r} section (tuned under policy {config.policy!r} "
            f"where the main values were tuned under {selection.profile.shapes_policy!r})"))
    return config, serving, selection


def served_policy(user: Mapping[str, Any]) -> str:
    """The accuracy policy the server runs by default: the user's, else ``LouverConfig``'s."""
    return str(user.get("policy", LouverConfig.policy))


def check_values(profile: Profile) -> None:
    """Raise ``ValueError`` unless ``profile``'s values (main, and under each policy section) make
    a valid config and serving options."""
    for policy in (None, *profile.policies):
        values = profile_values(profile if policy is None else profile.for_policy(policy))
        LouverConfig(**{k: v for k, v in values.items() if k in _CONFIG_KEYS})
        ServingOptions(**{k: v for k, v in values.items() if k not in _CONFIG_KEYS})


def profile_values(profile: Profile) -> dict[str, Any]:
    """A profile's config and launch values as options; launch keys must be ServingOptions fields."""
    launch_keys = {f.name for f in dataclasses.fields(ServingOptions)}
    kernel_keys = set()
    if profile.target == "cuda":  # Triton launch parameters and dispatch rules, read by the CUDA decode path
        from ..decode import dispatch

        kernel_keys = dispatch.kernel_keys()
        dispatch.check_section({k: v for k, v in profile.launch.items() if k in kernel_keys})
    unknown = sorted(set(profile.launch) - launch_keys - kernel_keys)
    if unknown:
        raise ProfileError(f"profile {profile.path or profile.device_name}: unknown launch parameters "
                           f"{unknown}; known: {sorted(launch_keys | kernel_keys)}")
    return {**profile.config, **{k: v for k, v in profile.launch.items() if k not in kernel_keys}}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{CONFIG_FILE_ENV}={path}: cannot read a JSON object ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{CONFIG_FILE_ENV}={path}: expected a JSON object, got {type(data).__name__}")
    return data


def _parse(name: str, raw: str, default: Any) -> Any:
    env = ENV_PREFIX + name.upper()
    try:
        if isinstance(default, bool):
            lowered = raw.strip().lower()
            if lowered not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError("expected a boolean (1/0/true/false)")
            return lowered in ("1", "true", "yes", "on")
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
        return raw
    except ValueError as exc:
        raise ValueError(f"{env}={raw!r}: {exc}") from exc
