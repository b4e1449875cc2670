"""The profile file: tuned defaults for one device, and the shapes and version they hold for.

One JSON object per device (see ``docs/tuning.md``)::

    {"target": "cpu" | "cuda", "device_name": raw name, "louver_version": "0.1.0",
     "config": {LouverConfig field: value},      # index layout and dispatch, never accuracy knobs
     "launch": {launch parameter: value},         # ServingOptions fields of the target's kernels
     "shapes": {"head_dim", "num_q_heads", "num_kv_heads", "kv_dtype",
                "context_lengths", "batch_sizes", "policy", "eps"},
     "measured": {...}}                           # defaults vs tuned latency, trials, date, command

A profile is only valid for the louver version and the attention shapes (head_dim, query and KV
heads per rank, KV dtype) it was tuned for; ``check_compatible`` says why it does not apply.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..config import LouverConfig
from .device import TARGETS

# The user's accuracy contract: a profile tunes speed, never how much attention mass may be dropped.
ACCURACY_KNOBS = ("policy", "eps", "budget", "fixed_threshold", "value_gate")
SHAPE_KEYS = ("head_dim", "num_q_heads", "num_kv_heads", "kv_dtype")
KV_DTYPES = ("float16", "bfloat16", "float32")


class ProfileError(ValueError):
    """A profile file that cannot be read, is malformed, or does not fit the served model."""


@dataclass(frozen=True)
class Shapes:
    """Attention shapes a profile was tuned for (per tensor-parallel rank).

    context_lengths and batch_sizes record what was measured; they do not restrict use.
    policy/eps record the accuracy setting the latencies were measured under.
    """

    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    kv_dtype: str
    context_lengths: tuple[int, ...] = ()
    batch_sizes: tuple[int, ...] = ()
    policy: str = "certified"
    eps: float = 1e-3

    def __post_init__(self) -> None:
        for name in ("head_dim", "num_q_heads", "num_kv_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ProfileError(f"shapes.{name} must be a positive int, got {value!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ProfileError(f"shapes.num_q_heads ({self.num_q_heads}) must be a multiple of "
                               f"num_kv_heads ({self.num_kv_heads})")
        if self.kv_dtype not in KV_DTYPES:
            raise ProfileError(f"shapes.kv_dtype must be one of {list(KV_DTYPES)}, got {self.kv_dtype!r}")

    def mismatches(self, served: "Shapes") -> list[str]:
        """``name: profile value != served value`` for every shape key that differs."""
        return [f"{k}: profile {getattr(self, k)!r} != served {getattr(served, k)!r}"
                for k in SHAPE_KEYS if getattr(self, k) != getattr(served, k)]


@dataclass(frozen=True)
class Profile:
    """A parsed, validated profile. ``config`` and ``launch`` are plain option dicts."""

    target: str
    device_name: str
    louver_version: str
    config: Mapping[str, Any]
    launch: Mapping[str, Any]
    shapes: Shapes
    measured: Mapping[str, Any] = field(default_factory=dict)
    path: str | None = None

    def __post_init__(self) -> None:
        where = f" ({self.path})" if self.path else ""
        if self.target not in TARGETS:
            raise ProfileError(f"profile{where}: target must be one of {list(TARGETS)}, got {self.target!r}")
        if not isinstance(self.device_name, str) or not self.device_name:
            raise ProfileError(f"profile{where}: device_name must be a non-empty string")
        check_config_overrides(self.config, where)
        check_launch(self.launch, where)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("path")
        data["shapes"]["context_lengths"] = list(self.shapes.context_lengths)
        data["shapes"]["batch_sizes"] = list(self.shapes.batch_sizes)
        return data

    @classmethod
    def from_dict(cls, data: Any, path: str | None = None) -> "Profile":
        where = f" ({path})" if path else ""
        if not isinstance(data, dict):
            raise ProfileError(f"profile{where}: expected a JSON object, got {type(data).__name__}")
        required = ("target", "device_name", "louver_version", "config", "launch", "shapes")
        missing = [k for k in required if k not in data]
        unknown = sorted(set(data) - set(required) - {"measured"})
        if missing or unknown:
            raise ProfileError(f"profile{where}: missing keys {missing}, unknown keys {unknown}")
        if not isinstance(data["shapes"], dict) or not isinstance(data["config"], dict) \
                or not isinstance(data["launch"], dict):
            raise ProfileError(f"profile{where}: config, launch and shapes must be JSON objects")
        try:
            shapes = Shapes(**{k: tuple(v) if isinstance(v, list) else v for k, v in data["shapes"].items()})
        except TypeError as exc:
            raise ProfileError(f"profile{where}: bad shapes ({exc})") from exc
        return cls(data["target"], data["device_name"], data["louver_version"], dict(data["config"]),
                   dict(data["launch"]), shapes, dict(data.get("measured", {})), path)

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        """Read and validate a profile file; raises ``ProfileError`` saying what is wrong."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ProfileError(f"profile {path}: cannot read a JSON object ({exc})") from exc
        return cls.from_dict(data, str(path))

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    def check_compatible(self, target: str, shapes: Shapes, version: str) -> None:
        """Raise ``ProfileError`` unless this profile was tuned for ``target``, ``shapes`` and ``version``."""
        problems = []
        if self.target != target:
            problems.append(f"target: profile {self.target!r} != served {target!r}")
        if self.louver_version != version:
            problems.append(f"louver_version: profile {self.louver_version!r} != installed {version!r}")
        problems += self.shapes.mismatches(shapes)
        if problems:
            raise ProfileError(f"profile {self.path or self.device_name} does not apply: " + "; ".join(problems))


def check_config_overrides(config: Mapping[str, Any], where: str = "") -> None:
    """Profile config keys must be LouverConfig fields other than the accuracy knobs, with valid values."""
    known = {f.name for f in dataclasses.fields(LouverConfig)}
    bad = sorted(set(config) - known)
    if bad:
        raise ProfileError(f"profile{where}: unknown config keys {bad}")
    accuracy = sorted(set(config) & set(ACCURACY_KNOBS))
    if accuracy:
        raise ProfileError(f"profile{where}: config must not set accuracy knobs {accuracy} "
                           "(they are the user's choice: LOUVER_POLICY, LOUVER_EPS, ...)")
    try:
        LouverConfig(**config)
    except (TypeError, ValueError) as exc:
        raise ProfileError(f"profile{where}: invalid config ({exc})") from exc


def check_launch(launch: Mapping[str, Any], where: str = "") -> None:
    """Launch parameters are named finite numbers (their ranges are checked by ``ServingOptions``)."""
    for name, value in launch.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ProfileError(f"profile{where}: launch.{name} must be a finite number, got {value!r}")
