"""The a-posteriori rule's estimate share per request and layer, adapted from the steps' own checks.

The one-pass rule a posteriori places its provisional level at the safe level of ``share`` times
the sample's estimate of Z; a larger share keeps fewer keys as long as the check D(T0) ≤ ε·Z_att
passes, and a head whose check fails costs its request a second attend pass (design notes,
"Certified a posteriori in one pass"). How large a share passes is a property of the request's
attention: on captured text share 8 passed where random tokens failed from share 6 on
(docs/benchmarks.md, "The a-posteriori rule's estimate share"). A request's steps in one layer
look alike from one token to the next, so each (request, layer) learns its own:

* it starts at the config's ``estimate_share``;
* a step where some head of the request was lowered (``StepStats.lowered``) halves it, not below
  ``SHARE_FLOOR`` (or the start, if lower);
* ``RAISE_AFTER`` steps in a row with no lowered head raise it by √2, up to ``estimate_share_max``.

Any share certifies (the check, not the share, bounds the dropped mass), so the control only
moves time. Host side: ``shares`` gives ``LouverDecode.run``'s ``estimate_share`` for a batch's
keys, ``update`` reads back the step's ``lowered``. Keys are any hashable per (request, layer),
e.g. ``(rid, layer_id)``; the least recently used are forgotten past ``capacity``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Hashable, Sequence

import torch

from ..config import LouverConfig

SHARE_FLOOR = 1.0  # the share a failing request falls to at most (the sample's estimate itself)
RAISE_AFTER = 8  # clean steps in a row before the share rises one notch
RAISE_FACTOR = math.sqrt(2.0)
DEFAULT_CAPACITY = 1 << 16  # (request, layer) entries kept: 2,000 requests of 32 layers


class ShareControl:
    """Estimate shares per (request, layer) key for one config (see the module docstring)."""

    def __init__(self, config: LouverConfig, capacity: int = DEFAULT_CAPACITY) -> None:
        if not config.adaptive_share:
            raise ValueError("ShareControl needs certified_rule='a_posteriori' and estimate_share_max above "
                             f"estimate_share; got {config.certified_rule!r}, estimate_share={config.estimate_share}, "
                             f"estimate_share_max={config.estimate_share_max}")
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.start, self.top, self.capacity = float(config.estimate_share), float(config.estimate_share_max), capacity
        self.floor = min(SHARE_FLOOR, self.start)
        self._state: OrderedDict[Hashable, list] = OrderedDict()  # key -> [share, clean steps in a row]

    def share(self, key: Hashable) -> float:
        """The share ``key``'s next step runs at."""
        entry = self._state.get(key)
        return self.start if entry is None else entry[0]

    def shares(self, keys: Sequence[Hashable]) -> torch.Tensor:
        """``[B]`` fp64 shares of a batch's keys, in order (``LouverDecode.run``'s ``estimate_share``)."""
        return torch.tensor([self.share(k) for k in keys], dtype=torch.float64)

    def update(self, keys: Sequence[Hashable], lowered: torch.Tensor) -> None:
        """Move each key's share after a step: ``lowered`` ``[B, H_q]`` (or ``[B]``) bool, the
        step's heads whose first level failed its check (``StepStats.lowered``)."""
        failed = (lowered.reshape(len(keys), -1).any(1) if len(keys) else lowered.new_zeros(0)).tolist()
        for key, fail in zip(keys, failed):
            entry = self._state.pop(key, None) or [self.start, 0]
            if fail:
                entry[0], entry[1] = max(self.floor, entry[0] / 2.0), 0
            else:
                entry[1] += 1
                if entry[1] >= RAISE_AFTER:
                    entry[0], entry[1] = min(self.top, entry[0] * RAISE_FACTOR), 0
            self._state[key] = entry
        while len(self._state) > self.capacity:
            self._state.popitem(last=False)

    @property
    def tracked(self) -> int:
        """How many keys have a share of their own (``len`` is left out: a control is always truthy)."""
        return len(self._state)
