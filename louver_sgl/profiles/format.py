"""The profile file: tuned defaults for one device, and the shapes and version they hold for.

One JSON object per device (see ``docs/tuning.md``)::

    {"target": "cpu" | "cuda", "device_name": raw name, "louver_version": "0.1.0",
     "isa": "avx512" | "avx2" | "sm90" | ...,    # the instruction set it was tuned on (optional)
     "config": {LouverConfig field: value},      # index layout and dispatch, never accuracy knobs
     "launch": {launch parameter: value},         # ServingOptions fields of the target's kernels
     "shapes": {"head_dim", "num_q_heads", "num_kv_heads", "kv_dtype",
                "context_lengths", "batch_sizes", "policy", "eps"},
     "measured": {...},                           # defaults vs tuned latency, trials, date, command
     "policies": {policy: {"config", "launch", "measured"}}}   # optional: tuned under another policy

``shapes.policy`` names the accuracy policy the main ``config`` and ``launch`` were tuned under. A
``policies`` section holds what ``louver-tune`` chose under another policy (its ``measured`` says
which eps); a server whose policy (``LOUVER_POLICY``) has a section uses the section's values over
the main ones (``for_policy``), since budget and certified steps may prefer other index designs.

A tuned profile is only valid for the louver version and the attention shapes (head_dim, query and
KV heads per rank, KV dtype) it was tuned for; ``check_compatible`` says why it does not apply.
A generic profile (``"generic": true``, no ``shapes``) is derived from the tuned ones of an ISA
(``profiles.generic``) and applies to any shapes of its target.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..config import POLICIES, LouverConfig
from .device import TARGETS

# The user's accuracy contract: a profile tunes speed, never how much attention mass may be dropped.
ACCURACY_KNOBS = ("policy", "eps", "budget", "fixed_threshold", "value_gate")
# Knobs whose best value moves with the KV dtype: where the sparse step starts to beat dense
# attention, and when falling back to dense pays, depend on how fast the dense path runs in that
# dtype (fp32 dense reads twice the bytes of fp16). The index layout and the launch of the sparse
# kernels do not: their codes and page terms are the same whatever the dtype of the keys.
DTYPE_DEPENDENT = ("min_sparse_tokens", "dense_fallback_fraction")
SHAPE_KEYS = ("head_dim", "num_q_heads", "num_kv_heads", "kv_dtype")
# Knobs only a certified step reads (how it finds T): a study under another policy cannot tune them,
# so its policy section never sets them (a server's certified requests keep the main values').
CERTIFIED_ONLY = ("certified_passes", "certified_rule", "estimate_share", "estimate_share_max", "one_scan")
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
    """A parsed, validated profile. ``config`` and ``launch`` are plain option dicts.

    shapes: what a tuned profile was tuned for (None for a generic one). isa: the instruction set
    of the device it was tuned on (CPU: from ``device_name`` when not written). generic: derived
    from the tuned profiles of ``isa`` (``profiles.generic``), for any shapes of its target.
    """

    target: str
    device_name: str
    louver_version: str
    config: Mapping[str, Any]
    launch: Mapping[str, Any]
    shapes: Shapes | None
    measured: Mapping[str, Any] = field(default_factory=dict)
    path: str | None = None
    isa: str | None = None
    generic: bool = False
    policies: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f" ({self.path})" if self.path else ""
        if self.target not in TARGETS:
            raise ProfileError(f"profile{where}: target must be one of {list(TARGETS)}, got {self.target!r}")
        if not isinstance(self.device_name, str) or not self.device_name:
            raise ProfileError(f"profile{where}: device_name must be a non-empty string")
        if (self.shapes is None) != self.generic:
            raise ProfileError(f"profile{where}: a tuned profile needs shapes, a generic one has none")
        if self.isa is None and self.target == "cpu" and not self.generic:
            object.__setattr__(self, "isa", self.device_name.split()[-1].lower())
        check_config_overrides(self.config, where)
        check_launch(self.launch, where)
        check_policy_sections(self.policies, where)

    def section(self, policy: str) -> Mapping[str, Any] | None:
        """The section tuned under ``policy``, if this profile has one."""
        return self.policies.get(policy)

    def for_policy(self, policy: str) -> "Profile":
        """This profile as a server of ``policy`` uses it: the main values, with those of the
        ``policies`` section tuned under ``policy`` over them (if it has one)."""
        section = self.section(policy)
        if section is None:
            return self
        return dataclasses.replace(self, config={**self.config, **policy_values(section.get("config", {}), policy)},
                                   launch={**self.launch, **policy_values(section.get("launch", {}), policy)})

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("path")
        if not self.policies:
            data.pop("policies")
        if not self.generic:
            data.pop("generic")
            data["shapes"]["context_lengths"] = list(self.shapes.context_lengths)
            data["shapes"]["batch_sizes"] = list(self.shapes.batch_sizes)
        else:
            data.pop("shapes")
        return data

    @property
    def shapes_policy(self) -> str | None:
        """The policy the main values were tuned under (None: generic)."""
        return None if self.shapes is None else self.shapes.policy

    @property
    def kv_dtype(self) -> str | None:
        """The KV dtype a tuned profile was tuned for (None: generic)."""
        return None if self.shapes is None else self.shapes.kv_dtype

    def describe(self) -> str:
        """``'AMD EPYC avx512' float16`` (tuned) or ``generic avx512`` (generic), for log lines."""
        return f"generic {self.isa or self.target}" if self.generic else f"{self.device_name!r} {self.kv_dtype}"

    @classmethod
    def from_dict(cls, data: Any, path: str | None = None) -> "Profile":
        where = f" ({path})" if path else ""
        if not isinstance(data, dict):
            raise ProfileError(f"profile{where}: expected a JSON object, got {type(data).__name__}")
        generic = data.get("generic", False)
        if not isinstance(generic, bool):
            raise ProfileError(f"profile{where}: generic must be true or false, got {generic!r}")
        required = ("target", "device_name", "louver_version", "config", "launch") + (() if generic else ("shapes",))
        missing = [k for k in required if k not in data]
        unknown = sorted(set(data) - set(required) - {"measured", "isa", "generic", "policies"})
        if missing or unknown:
            raise ProfileError(f"profile{where}: missing keys {missing}, unknown keys {unknown}")
        if not isinstance(data["config"], dict) or not isinstance(data["launch"], dict) \
                or not isinstance(data.get("shapes", {}), dict):
            raise ProfileError(f"profile{where}: config, launch and shapes must be JSON objects")
        isa = data.get("isa")
        if isa is not None and (not isinstance(isa, str) or not isa):
            raise ProfileError(f"profile{where}: isa must be a non-empty string, got {isa!r}")
        policies = data.get("policies", {})
        if not isinstance(policies, dict):
            raise ProfileError(f"profile{where}: policies must be a JSON object, got {type(policies).__name__}")
        return cls(data["target"], data["device_name"], data["louver_version"], dict(data["config"]),
                   dict(data["launch"]), None if generic else _shapes(data["shapes"], where),
                   dict(data.get("measured", {})), path, isa, generic, policies)

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
        problems = self.version_problems(target, version)
        if self.shapes is not None:
            problems += self.shapes.mismatches(shapes)
        if problems:
            raise ProfileError(f"profile {self.path or self.device_name} does not apply: " + "; ".join(problems))

    def version_problems(self, target: str, version: str) -> list[str]:
        """Why this profile cannot serve ``target`` with louver ``version`` at all (any shapes)."""
        problems = []
        if self.target != target:
            problems.append(f"target: profile {self.target!r} != served {target!r}")
        if self.louver_version != version:
            problems.append(f"louver_version: profile {self.louver_version!r} != installed {version!r}")
        return problems

    def with_values(self, config: Mapping[str, Any], launch: Mapping[str, Any]) -> "Profile":
        """This profile with some config and launch values replaced (validated again)."""
        return dataclasses.replace(self, config={**self.config, **config}, launch={**self.launch, **launch})


def policy_values(values: Mapping[str, Any], policy: str) -> dict[str, Any]:
    """The values of a section tuned under ``policy`` that it may set (``CERTIFIED_ONLY`` only
    under certified)."""
    certified = LouverConfig(policy=policy).threshold.certified
    return {k: v for k, v in values.items() if certified or k not in CERTIFIED_ONLY}


def merge_tuned(existing: Profile | None, tuned: Profile) -> tuple[Profile, str]:
    """Where ``louver-tune`` exports ``tuned`` over the profile ``existing`` at the same path: a
    profile of the same device, version and attention shapes tuned under another policy keeps its
    main values and takes ``tuned``'s (``policy_values``) as the section of ``tuned``'s policy;
    otherwise ``tuned`` replaces it (keeping its other policies' sections where they fit). Returns
    the profile to write and what was done, in words."""
    policy = tuned.shapes_policy
    same = (existing is not None and not existing.generic and tuned.shapes is not None
            and not existing.version_problems(tuned.target, tuned.louver_version)
            and existing.device_name == tuned.device_name and not existing.shapes.mismatches(tuned.shapes))
    if not same:
        return tuned, "written (no profile of this device and shapes there)"
    if existing.shapes_policy != policy:
        section = {"config": policy_values(tuned.config, policy), "launch": policy_values(tuned.launch, policy),
                   "measured": {**tuned.measured, "eps": tuned.shapes.eps}}  # settings hold a budget's fraction
        merged = dataclasses.replace(existing, policies={**existing.policies, policy: section}, path=None)
        return merged, (f"added as its {policy!r} section (its main values were tuned under "
                        f"{existing.shapes_policy!r} and stay)")
    kept = {k: v for k, v in existing.policies.items() if k != policy}
    tuned, carried, dropped = carry_hand_set(existing, tuned)
    done = f"main values replaced (tuned under {policy!r} again)" + (f"; sections {sorted(kept)} kept" if kept else "")
    if carried:
        done += f"; hand-set {carried} kept (measured.hand_set)"
    if dropped:
        done += f"; hand-set {dropped} dropped (this study searched them)"
    return dataclasses.replace(tuned, policies=kept), done


# measured.hand_set: values set by hand in a tuned profile's main config or launch, each a key of
# that record, beside the record's own words (why, date, command). louver-tune does not search
# them, so a re-tune of the main values keeps them (carry_hand_set).
HAND_SET_NOTES = ("why", "date", "command")


def carry_hand_set(existing: Profile, tuned: Profile) -> tuple[Profile, list[str], list[str]]:
    """``tuned`` (the same device, shapes and policy as ``existing``) with ``existing``'s hand-set
    main values (``measured.hand_set``) and their record carried over, except the keys ``tuned``'s
    study searched (``measured.tuned.params``): there the study's value stands and the key leaves
    the record. Returns the profile and the keys carried and dropped."""
    record = dict(existing.measured.get("hand_set") or {})
    keys = [k for k in record if k not in HAND_SET_NOTES]
    if not keys:
        return tuned, [], []
    searched = set((tuned.measured.get("tuned") or {}).get("params") or {})
    # each from where the profile holds it (a key it does not hold is not carried)
    carried = [k for k in keys if k not in searched and (k in existing.config or k in existing.launch)]
    dropped = [k for k in keys if k in searched]
    config = {**tuned.config, **{k: existing.config[k] for k in carried if k in existing.config}}
    launch = {**tuned.launch, **{k: existing.launch[k] for k in carried if k in existing.launch}}
    measured = dict(tuned.measured)
    if carried:
        measured["hand_set"] = {k: v for k, v in record.items() if k in carried or k in HAND_SET_NOTES}
    return dataclasses.replace(tuned, config=config, launch=launch, measured=measured), carried, dropped


def _shapes(data: Mapping[str, Any], where: str) -> Shapes:
    try:
        return Shapes(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
    except TypeError as exc:
        raise ProfileError(f"profile{where}: bad shapes ({exc})") from exc


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


SECTION_KEYS = ("config", "launch", "measured")


def check_policy_sections(policies: Mapping[str, Any], where: str = "") -> None:
    """A profile's ``policies``: per accuracy policy an object of ``config`` and ``launch``
    values (checked as the main ones) and what was ``measured``."""
    for policy, section in policies.items():
        at = f"{where} (policies.{policy})"
        if policy not in POLICIES:
            raise ProfileError(f"profile{where}: policies has a section for {policy!r}; policies are {list(POLICIES)}")
        if not isinstance(section, Mapping) or set(section) - set(SECTION_KEYS):
            raise ProfileError(f"profile{at}: a policy section is an object with keys among {list(SECTION_KEYS)}")
        if not all(isinstance(section.get(k, {}), Mapping) for k in SECTION_KEYS):
            raise ProfileError(f"profile{at}: config, launch and measured must be JSON objects")
        check_config_overrides(section.get("config", {}), at)
        check_launch(section.get("launch", {}), at)


STRING_LAUNCH = ("cuda_decode",)  # launch values that are names
BOOL_LAUNCH = ("one_scan", "residual_weights")  # launch values that are switches (the compiled CPU step's)


def check_launch(launch: Mapping[str, Any], where: str = "") -> None:
    """Launch parameters are named finite numbers, names (``cuda_decode``) or switches (``one_scan``,
    ``residual_weights``); a CUDA profile's may also hold one object of numbers per implementation
    and a list of dispatch rules (their ranges and fields are checked by ``ServingOptions``,
    ``TritonLaunch`` and ``decode.dispatch``)."""
    for name, value in launch.items():
        if name in STRING_LAUNCH and isinstance(value, str) and value.strip():
            continue
        if name in BOOL_LAUNCH and isinstance(value, bool):
            continue
        if isinstance(value, Mapping):
            check_launch(value, f"{where} (launch.{name})")
            continue
        if isinstance(value, list) and all(isinstance(rule, Mapping) for rule in value):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ProfileError(f"profile{where}: launch.{name} must be a finite number, got {value!r}")
