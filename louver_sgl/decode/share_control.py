"""The a-posteriori rule's estimate share per request and layer, adapted from the steps' own checks.

The one-pass rule a posteriori places its provisional level at the safe level of ``share`` times
the sample's estimate of Z; a larger share keeps fewer keys as long as the check D(T0) ≤ ε·Z_att
passes, and a head whose check fails costs its request a second attend pass (design notes,
"Certified a posteriori in one pass"). How large a share passes depends on the layer and the
text, and a request's steps in one layer look alike from one token to the next (docs/benchmarks.md,
"The estimate share over consecutive decode steps"), so each (request, layer) keeps its own:

* it starts at the config's ``estimate_share``;
* a step where some head of the request was lowered (``StepStats.lowered``) divides it by
  ``STEP`` (√2), not below ``SHARE_FLOOR`` (or the start, if lower);
* after ``RAISE_AFTER`` steps in a row with no lowered head, the first step whose largest
  reported bound (``StepStats.mass_bound``, the certificate D(T0)/Z_att) lies below
  ``RAISE_BELOW``·ε multiplies it by ``STEP``, up to ``estimate_share_max``.

The bound is what makes a raise safe: over 128 consecutive steps of captured text and of random
tokens (16K and 8K, five layers, ε = 1e-2 and 1e-3, every share from 1 to 32), a step that passed
with its bound below 0.6·ε passed at √2 times the share too in all but 1 of 14,894 cases, one at
0.8·ε or above in 1 of 1,663.

Any share certifies (the check, not the share, bounds the dropped mass), so the control only
moves time. Host side: ``shares`` gives ``LouverDecode.run``'s ``estimate_share`` for a batch's
keys, ``update`` (or ``update_step``, from the ``StepStats``) reads back the step's ``lowered`` and
``mass_bound``. Keys are any hashable per (request, layer), e.g. ``(rid, layer_id)``; the least
recently used are forgotten past ``capacity``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Hashable, Sequence

import torch

from ..config import LouverConfig

SHARE_FLOOR = 1.0  # the share a failing request falls to at most (the sample's estimate itself)
STEP = math.sqrt(2.0)  # one notch up or down
RAISE_AFTER = 16  # clean steps in a row before the share may rise one notch
RAISE_BELOW = 0.6  # ... on a step whose largest bound was below this share of eps
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
        self.eps = float(config.eps)
        self._state: OrderedDict[Hashable, list] = OrderedDict()  # key -> [share, clean steps in a row]

    def share(self, key: Hashable) -> float:
        """The share ``key``'s next step runs at."""
        entry = self._state.get(key)
        return self.start if entry is None else entry[0]

    def shares(self, keys: Sequence[Hashable]) -> torch.Tensor:
        """``[B]`` fp64 shares of a batch's keys, in order (``LouverDecode.run``'s ``estimate_share``)."""
        return torch.tensor([self.share(k) for k in keys], dtype=torch.float64)

    def update(self, keys: Sequence[Hashable], lowered: torch.Tensor, mass_bound: torch.Tensor) -> None:
        """Move each key's share after a step: ``lowered`` ``[B, H_q]`` bool (the heads whose first
        level failed its check) and ``mass_bound`` ``[B, H_q]`` (their certified bounds), the
        step's ``StepStats`` fields."""
        if not keys:
            return
        failed = lowered.reshape(len(keys), -1).any(1).tolist()
        roomy = (mass_bound.reshape(len(keys), -1).amax(1) < RAISE_BELOW * self.eps).tolist()  # NaN: no room
        self._move(keys, failed, roomy)

    def update_step(self, keys: Sequence[Hashable], stats) -> None:
        """``update`` from the step's ``StepStats``. The compiled step's packed statistics are read
        with one host copy and no tensor of their own (on the decode path every torch call costs
        microseconds once the layer's step has swept the caches)."""
        if stats.packed is None:
            return self.update(keys, stats.lowered, stats.mass_bound)
        if keys:  # NaN bounds leave no room, as amax(...) < limit does in update
            self._move(keys, *stats.packed_checks(RAISE_BELOW * self.eps))

    def _move(self, keys: Sequence[Hashable], failed: Sequence[bool], roomy: Sequence[bool]) -> None:
        """Each key's share after a step where some head of it failed its check (``failed``) and
        where every bound lay below RAISE_BELOW·ε (``roomy``)."""
        for key, fail, room in zip(keys, failed, roomy):
            entry = self._state.pop(key, None) or [self.start, 0]
            if fail:
                entry[0], entry[1] = max(self.floor, entry[0] / STEP), 0
            else:
                entry[1] += 1
                if entry[1] >= RAISE_AFTER and room:
                    entry[0], entry[1] = min(self.top, entry[0] * STEP), 0
            self._state[key] = entry
        while len(self._state) > self.capacity:
            self._state.popitem(last=False)

    @property
    def tracked(self) -> int:
        """How many keys have a share of their own (``len`` is left out: a control is always truthy)."""
        return len(self._state)
