"""Accuracy chosen per request: ``sampling_params.custom_params["louver"]``.

A request may set louver's threshold policy and its parameter for itself, e.g.
``{"custom_params": {"louver": {"policy": "certified", "eps": 1e-4}}}`` or ``{"policy": "dense"}``,
through ``/generate`` (``sampling_params``) and the OpenAI endpoints (``custom_params`` of the
request body). The fields are the accuracy knobs (``profiles.ACCURACY_KNOBS``: ``policy``,
``eps``, ``budget``, ``fixed_threshold``, ``value_gate``) with the meanings and ranges of
``LouverConfig``; fields left out keep the server's values, and the index layout stays the
server's (its pages are shared by every request).

Two hooks carry them:

* ``SamplingParams.verify`` (the tokenizer side, before the request reaches the scheduler): a
  malformed ``louver`` entry raises ``ValueError`` naming the field and its allowed range, which
  SGLang's HTTP server answers with status 400 (also a parameter of another policy than the
  request's, such as ``eps`` on a budget request). A valid entry is replaced by its parsed,
  canonical form (``RequestPolicy.as_entry``), so only parsed values travel past the front door;
* ``ForwardBatch.init_new`` (the scheduler side): the policies of the batch's requests that
  asked for their own are kept by request id (SGLang's runners copy the forward batch into
  static buffers, so nothing attached to it survives), and the CPU decode path looks its
  batch's request ids up (``requests_of``) and groups by them (``cpu_path``). Nothing there
  parses or raises: a request whose entry did not pass the front door is served with the
  server's policy and logged, and its neighbours in the batch are untouched.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping

from ..config import LouverConfig
from ..profiles.format import ACCURACY_KNOBS

logger = logging.getLogger(__name__)
KEY = "louver"
PARSED = "parsed"  # the key of an entry the front door parsed (``RequestPolicy.as_entry``)
# request id -> policy of the scheduled requests that chose their own (most recently scheduled
# last; each forward refreshes its requests, so only finished ones age out past the limit)
_CHOSEN: OrderedDict[str, RequestPolicy] = OrderedDict()
TRACKED_LIMIT = 4096
VERIFY_TARGET = "sglang.srt.sampling.sampling_params.SamplingParams.verify"
BATCH_TARGET = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
# What this process serves, set at server-argument resolution: "cpu" or "cuda" (louver serves
# decode there), "off" (another backend); None where no server was resolved here (checks only).
_served: str | None = None
_served_policy: str | None = None  # the server's policy kind, where a server was resolved here
_TYPES = {"policy": (str,), "eps": (int, float), "budget": (int, float), "fixed_threshold": (int, float),
          "value_gate": (bool,)}
# the policies each parameter means something to (``LouverConfig``); elsewhere it would be ignored
_APPLIES = {"eps": ("certified",), "budget": ("budget",), "fixed_threshold": ("fixed",),
            "value_gate": ("budget", "fixed")}


@dataclass(frozen=True)
class RequestPolicy:
    """One request's accuracy knobs (a subset of ``ACCURACY_KNOBS``), validated; hashable, so the
    requests of a batch that asked for the same are one group."""

    values: tuple[tuple[str, Any], ...]

    def apply(self, config: LouverConfig) -> LouverConfig:
        """The server's ``config`` with this request's knobs."""
        return config.with_(**dict(self.values))

    def as_entry(self) -> dict[str, Any]:
        """The parsed form the front door leaves in ``custom_params["louver"]`` (JSON scalars: it
        crosses SGLang's msgpack IPC to the scheduler)."""
        return {PARSED: True, **dict(self.values)}

    @classmethod
    def carried(cls, entry: Any) -> RequestPolicy | None:
        """The policy of an entry the front door parsed (``as_entry``); None for anything else
        (never raises: it runs in the scheduler, beside other requests)."""
        if not isinstance(entry, Mapping) or entry.get(PARSED) is not True:
            return None
        values = tuple(sorted((k, v) for k, v in entry.items() if k != PARSED))
        if any(k not in _TYPES for k, _ in values):
            return None
        return cls(values)


def parse(custom_params: Any, served_policy: str | None = None) -> RequestPolicy | None:
    """The ``louver`` entry of a request's ``custom_params`` (None where there is none); raises
    ``ValueError`` naming the field and what it allows. ``served_policy``: the server's policy
    kind, which a request without a ``policy`` field keeps (its parameters must apply to it)."""
    if not isinstance(custom_params, Mapping) or custom_params.get(KEY) is None:
        return None
    entry = custom_params[KEY]
    if not isinstance(entry, Mapping):
        raise ValueError(f"custom_params.{KEY} must be an object of {list(ACCURACY_KNOBS)}, got {entry!r}")
    entry = {k: v for k, v in entry.items() if k != PARSED}  # an entry parsed before is parsed again
    unknown = sorted(set(entry) - set(ACCURACY_KNOBS))
    if unknown:
        raise ValueError(f"custom_params.{KEY}: unknown field(s) {unknown}; allowed: {list(ACCURACY_KNOBS)} "
                         "(the index layout is the server's)")
    values = tuple(sorted((name, _checked(name, value)) for name, value in entry.items()))
    try:
        LouverConfig().with_(**dict(values))  # the config's own checks name the field and its range
    except ValueError as exc:
        raise ValueError(f"custom_params.{KEY}.{exc}") from exc
    _check_applies(dict(values), served_policy)
    return RequestPolicy(values)


def _checked(name: str, value: Any) -> Any:
    """``value`` of field ``name`` in its canonical type (numbers as float), or ``ValueError``."""
    kinds = _TYPES[name]
    if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
        raise ValueError(f"custom_params.{KEY}.{name} must be a {' or '.join(k.__name__ for k in kinds)}, "
                         f"got {value!r}")
    if kinds != (int, float):
        return value
    try:
        number = float(value)
    except OverflowError:  # an integer of hundreds of digits
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"custom_params.{KEY}.{name} must be a finite number, got {_short(value)}")
    return number


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def _check_applies(values: dict[str, Any], served_policy: str | None) -> None:
    """A parameter of another policy than the request's (its own ``policy`` field, else the
    server's where known) would be ignored: refuse it instead."""
    policy = values.get("policy", served_policy)
    if policy is None:
        return
    for name, policies in _APPLIES.items():
        if name in values and policy not in policies:
            whose = "this request's" if "policy" in values else "the server's"
            raise ValueError(f"custom_params.{KEY}.{name} applies to the {' and '.join(policies)} "
                             f"polic{'ies' if len(policies) > 1 else 'y'}, not to {whose} policy {policy!r}")


def set_served(device: str, policy: str | None = None) -> None:
    """Record, at server-argument resolution, what this server runs decode in (``cpu``, ``cuda``,
    or ``off`` when its attention backend is not louver) and its policy kind."""
    global _served, _served_policy
    _served, _served_policy = device, policy


def verified(original, self, *args, **kwargs):
    """The ``SamplingParams.verify`` hook: SGLang's checks, then the ``louver`` entry's, which is
    replaced by its parsed form (``RequestPolicy.as_entry``)."""
    result = original(self, *args, **kwargs)
    custom = getattr(self, "custom_params", None)
    policy = parse(custom, _served_policy)
    if policy is not None and _served in ("off", "cuda"):
        raise ValueError(f"custom_params.{KEY}: " + ("this server's attention backend is not louver" if _served == "off"
                         else "per-request policies are served by louver's CPU decode path only so far; this server "
                              "decodes on CUDA, where its decode graphs run the server's policy"))
    if policy is not None:
        self.custom_params = {**custom, KEY: policy.as_entry()}
    return result


def with_requests(original, cls, batch, *args, **kwargs):
    """The ``ForwardBatch.init_new`` hook: keep the policies of the batch's requests by id (the
    front door's parsed entries; nothing is parsed here)."""
    for req in getattr(batch, "reqs", None) or []:
        custom = getattr(getattr(req, "sampling_params", None), "custom_params", None)
        entry = custom.get(KEY) if isinstance(custom, Mapping) else None
        policy = RequestPolicy.carried(entry)
        if policy is None and entry is not None:
            logger.error("louver: request %s carries a louver entry the front door did not parse; it is served "
                         "with the server's policy", getattr(req, "rid", "?"))
        if policy is None:
            _CHOSEN.pop(req.rid, None)
        else:
            _CHOSEN[req.rid] = policy
            _CHOSEN.move_to_end(req.rid)
    while len(_CHOSEN) > TRACKED_LIMIT:
        _CHOSEN.popitem(last=False)
    return original(cls, batch, *args, **kwargs)


def requests_of(forward_batch, batch_size: int) -> list[RequestPolicy | None] | None:
    """The per-request policies of a forward batch of ``batch_size`` requests by its request ids
    (None: every request takes the server's, also where the ids do not match the batch's rows,
    which is logged: a policy is never applied to another request's row)."""
    rids = getattr(forward_batch, "rids", None)
    if not _CHOSEN or not rids:
        return None
    if len(rids) != batch_size:
        logger.warning("louver: a decode batch of %d requests carries %d request ids; its requests take the server's "
                       "policy", batch_size, len(rids))
        return None
    policies = [_CHOSEN.get(rid) for rid in rids]
    return policies if any(p is not None for p in policies) else None


def describe(config: LouverConfig, own: bool) -> dict[str, Any]:
    """What a request's account shows of the policy it got."""
    policy = config.threshold
    values: dict[str, Any] = {"policy": policy.kind, "source": "request" if own else "server"}
    if policy.certified:
        values["eps"] = policy.eps
    elif policy.budget_rule:
        values["budget"] = policy.budget
    elif policy.fixed:
        values["fixed_threshold"] = policy.fixed_threshold
    return values


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(VERIFY_TARGET, verified, HookType.AROUND)
    HookRegistry.register(BATCH_TARGET, with_requests, HookType.AROUND)
