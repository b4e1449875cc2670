"""Which Triton implementation a CUDA decode batch runs, and with which launch parameters.

A CUDA profile's ``launch`` section holds the launch parameters shared by the implementations
(``TritonLaunch`` fields), one object per implementation whose fields override them for it
(``"triton_stream": {"pages_per_split": 32}``: the streaming filter's segments and the fused
kernel's splits are both ``pages_per_split``, and their best values differ), and
``cuda_dispatch``, the rules that choose the implementation when ``cuda_decode`` is ``auto``:

    "cuda_dispatch": [{"impl": "triton_stream", "policies": ["budget", "fixed"], "min_rows": 64},
                      {"impl": "triton_stream", "policies": ["budget"], "min_rows": 8, "min_context": 131072}]

The first rule whose conditions all hold names the implementation, else ``triton``. Rows are the
batch's (request, KV head) pairs: the work a filter spreads over the GPU. A captured decode graph
fixes its batch size, so the choice is made per batch size (and the server's context length),
never per step: it is graph-safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from louver_kernels.triton.launch import TritonLaunch

CUDA_IMPLEMENTATIONS = ("triton", "triton_stream", "triton_tiled")
DISPATCH_KEY = "cuda_dispatch"
DEFAULT_IMPLEMENTATION = "triton"
_RULE_FIELDS = {"impl", "policies", "min_rows", "min_context"}


@dataclass(frozen=True)
class DispatchRule:
    """Run ``impl`` where the policy is one of ``policies`` (all when empty), the batch has at
    least ``min_rows`` (request, KV head) rows and the server at least ``min_context`` tokens."""

    impl: str
    policies: tuple[str, ...] = ()
    min_rows: int = 0
    min_context: int = 0

    @classmethod
    def parse(cls, data: Any) -> "DispatchRule":
        if not isinstance(data, Mapping) or "impl" not in data:
            raise ValueError(f"a {DISPATCH_KEY} rule must be an object with an 'impl', got {data!r}")
        unknown = sorted(set(data) - _RULE_FIELDS)
        if unknown:
            raise ValueError(f"unknown {DISPATCH_KEY} rule fields {unknown}; known: {sorted(_RULE_FIELDS)}")
        if data["impl"] not in CUDA_IMPLEMENTATIONS:
            raise ValueError(f"{DISPATCH_KEY} impl must be one of {list(CUDA_IMPLEMENTATIONS)}, got {data['impl']!r}")
        policies = data.get("policies", [])
        if not isinstance(policies, list) or not all(isinstance(p, str) for p in policies):
            raise ValueError(f"{DISPATCH_KEY} policies must be a list of policy names, got {policies!r}")
        for name in ("min_rows", "min_context"):
            value = data.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{DISPATCH_KEY} {name} must be a non-negative int, got {value!r}")
        return cls(data["impl"], tuple(policies), int(data.get("min_rows", 0)), int(data.get("min_context", 0)))

    def matches(self, policy: str, rows: int, context: int) -> bool:
        return (not self.policies or policy in self.policies) and rows >= self.min_rows and context >= self.min_context


def parse_rules(section: Mapping[str, Any] | None) -> tuple[DispatchRule, ...]:
    """The dispatch rules of a profile's launch section (none: always ``triton``)."""
    rules = (section or {}).get(DISPATCH_KEY, [])
    if not isinstance(rules, Sequence) or isinstance(rules, (str, bytes)):
        raise ValueError(f"{DISPATCH_KEY} must be a list of rules, got {rules!r}")
    return tuple(DispatchRule.parse(r) for r in rules)


def choose(rules: Sequence[DispatchRule], policy: str, rows: int, context: int) -> str:
    """The implementation of the first matching rule, else ``DEFAULT_IMPLEMENTATION``."""
    return next((r.impl for r in rules if r.matches(policy, rows, context)), DEFAULT_IMPLEMENTATION)


def launch_for(section: Mapping[str, Any] | None, impl: str) -> TritonLaunch:
    """``impl``'s launch parameters: the section's shared ``TritonLaunch`` fields, then its own
    object's (raises ``ValueError`` naming an unknown key)."""
    section = dict(section or {})
    shared = {k: v for k, v in section.items() if k not in CUDA_IMPLEMENTATIONS and k != DISPATCH_KEY}
    own = section.get(impl, {})
    if not isinstance(own, Mapping):
        raise ValueError(f"the launch section's {impl!r} entry must be an object, got {own!r}")
    return TritonLaunch.from_dict({**shared, **own})


def check_section(section: Mapping[str, Any]) -> None:
    """Validate a CUDA launch section: every implementation's launch and the rules."""
    for impl in CUDA_IMPLEMENTATIONS:
        launch_for(section, impl)
    parse_rules(section)


def kernel_keys() -> set[str]:
    """The launch-section keys the CUDA decode path reads (the rest are serving options)."""
    from dataclasses import fields

    return {f.name for f in fields(TritonLaunch)} | set(CUDA_IMPLEMENTATIONS) | {DISPATCH_KEY}
