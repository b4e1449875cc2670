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
  SGLang's HTTP server answers with status 400;
* ``ForwardBatch.init_new`` (the scheduler side): the policies of the batch's requests that
  asked for their own are kept by request id (SGLang's runners copy the forward batch into
  static buffers, so nothing attached to it survives), and the CPU decode path looks its
  batch's request ids up (``requests_of``) and groups by them (``cpu_path``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping

from ..config import LouverConfig
from ..profiles.format import ACCURACY_KNOBS

KEY = "louver"
# request id -> policy of the scheduled requests that chose their own (most recently scheduled
# last; each forward refreshes its requests, so only finished ones age out past the limit)
_CHOSEN: OrderedDict[str, RequestPolicy] = OrderedDict()
TRACKED_LIMIT = 4096
VERIFY_TARGET = "sglang.srt.sampling.sampling_params.SamplingParams.verify"
BATCH_TARGET = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
# What this process serves, set at server-argument resolution: "cpu" or "cuda" (louver serves
# decode there), "off" (another backend); None where no server was resolved here (checks only).
_served: str | None = None
_TYPES = {"policy": (str,), "eps": (int, float), "budget": (int, float), "fixed_threshold": (int, float),
          "value_gate": (bool,)}


@dataclass(frozen=True)
class RequestPolicy:
    """One request's accuracy knobs (a subset of ``ACCURACY_KNOBS``), validated; hashable, so the
    requests of a batch that asked for the same are one group."""

    values: tuple[tuple[str, Any], ...]

    def apply(self, config: LouverConfig) -> LouverConfig:
        """The server's ``config`` with this request's knobs."""
        return config.with_(**dict(self.values))


def parse(custom_params: Any) -> RequestPolicy | None:
    """The ``louver`` entry of a request's ``custom_params`` (None where there is none); raises
    ``ValueError`` naming the field and what it allows."""
    if not isinstance(custom_params, Mapping) or custom_params.get(KEY) is None:
        return None
    entry = custom_params[KEY]
    if not isinstance(entry, Mapping):
        raise ValueError(f"custom_params.{KEY} must be an object of {list(ACCURACY_KNOBS)}, got {entry!r}")
    unknown = sorted(set(entry) - set(ACCURACY_KNOBS))
    if unknown:
        raise ValueError(f"custom_params.{KEY}: unknown field(s) {unknown}; allowed: {list(ACCURACY_KNOBS)} "
                         "(the index layout is the server's)")
    for name, value in entry.items():
        kinds = _TYPES[name]
        if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
            raise ValueError(f"custom_params.{KEY}.{name} must be a {' or '.join(k.__name__ for k in kinds)}, "
                             f"got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"custom_params.{KEY}.{name} must be finite, got {value!r}")
    values = tuple(sorted((k, float(v) if _TYPES[k] == (int, float) else v) for k, v in entry.items()))
    try:
        LouverConfig().with_(**dict(values))  # the config's own checks name the field and its range
    except ValueError as exc:
        raise ValueError(f"custom_params.{KEY}.{exc}") from exc
    return RequestPolicy(values)


def set_served(device: str) -> None:
    """Record, at server-argument resolution, what this server runs decode in (``cpu``, ``cuda``,
    or ``off`` when its attention backend is not louver)."""
    global _served
    _served = device


def verified(original, self, *args, **kwargs):
    """The ``SamplingParams.verify`` hook: SGLang's checks, then the ``louver`` entry's."""
    result = original(self, *args, **kwargs)
    if parse(getattr(self, "custom_params", None)) is not None and _served in ("off", "cuda"):
        raise ValueError(f"custom_params.{KEY}: " + ("this server's attention backend is not louver" if _served == "off"
                         else "per-request policies are served by louver's CPU decode path only so far; this server "
                              "decodes on CUDA, where its decode graphs run the server's policy"))
    return result


def with_requests(original, cls, batch, *args, **kwargs):
    """The ``ForwardBatch.init_new`` hook: keep the policies of the batch's requests by id."""
    for req in getattr(batch, "reqs", None) or []:
        policy = parse(getattr(getattr(req, "sampling_params", None), "custom_params", None))
        if policy is None:
            _CHOSEN.pop(req.rid, None)
        else:
            _CHOSEN[req.rid] = policy
            _CHOSEN.move_to_end(req.rid)
    while len(_CHOSEN) > TRACKED_LIMIT:
        _CHOSEN.popitem(last=False)
    return original(cls, batch, *args, **kwargs)


def requests_of(forward_batch) -> list[RequestPolicy | None] | None:
    """The per-request policies of a forward batch by its request ids (None: every request
    takes the server's)."""
    rids = getattr(forward_batch, "rids", None)
    if not _CHOSEN or not rids:
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
