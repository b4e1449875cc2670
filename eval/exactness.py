"""Exactness at scale: every layer, query head and decode step checked against an fp64 brute force.

``ExactnessObserver`` plugs into ``DecodeRunner``. For each (layer, step) it recomputes every score
of the query against the whole cache in fp64 and checks:

* recall: every key with exact score >= T (the step's fp32 threshold, compared in fp64) was
  attended — the count of missed keys must be zero;
* the dropped softmax mass measured in fp64 (dense probability of every key not attended) against
  the step's reported bound ``mass_bound``.

It accumulates per-layer totals (query-steps, keys at or above T, missed keys, candidate and
page-survival fractions, dense fallbacks, bound violations) and keeps every (bound, measured) pair
for the distribution plots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .hf_decode import LayerKV, StepRecord

# The bound and the measurement are computed in fp64 along different paths (fp32 scores inside
# the step, fp64 scores here); this absolute slack is the same as the repository's exactness tests.
MASS_SLACK = 1e-12


@dataclass
class LayerTotals:
    """Sums over every (step, query head) of one layer."""

    query_steps: int = 0
    at_or_above_t: int = 0
    missed: int = 0
    candidate_fraction: float = 0.0
    page_survival: float = 0.0
    fallback_steps: int = 0
    steps: int = 0
    bound_violations: int = 0

    def as_dict(self) -> dict:
        n = max(self.query_steps, 1)
        return {
            "query_steps": self.query_steps, "steps": self.steps, "keys_at_or_above_T": self.at_or_above_t,
            "missed": self.missed,
            "recall": 1.0 if self.at_or_above_t == 0 else 1.0 - self.missed / self.at_or_above_t,
            "candidate_fraction": self.candidate_fraction / n, "page_survival": self.page_survival / n,
            "dense_fallback_steps": self.fallback_steps, "bound_violations": self.bound_violations,
        }


@dataclass
class ExactnessObserver:
    """Observer for ``DecodeRunner``; needs a louver policy (records carrying ``stats``)."""

    layers: dict[int, LayerTotals] = field(default_factory=dict)
    bounds: list[np.ndarray] = field(default_factory=list)
    measured: list[np.ndarray] = field(default_factory=list)
    context: list[np.ndarray] = field(default_factory=list)

    def __call__(self, layer: int, q: torch.Tensor, kv: LayerKV, sigma: float, record: StepRecord) -> None:
        stats = record.stats
        if stats is None:
            raise ValueError("the exactness observer needs a louver policy (a record with stats)")
        keys, heads = kv.keys(), q.shape[0]
        scores = torch.einsum("hd,lhd->hl", q.double(),
                              keys.double().repeat_interleave(heads // keys.shape[1], dim=1))
        must = scores >= stats.threshold[0].double()[:, None]
        dropped = (torch.softmax(sigma * scores, dim=1) * ~record.attended).sum(1)
        bound = stats.mass_bound[0]
        totals = self.layers.setdefault(layer, LayerTotals())
        totals.steps += 1
        totals.query_steps += heads
        totals.at_or_above_t += int(must.sum())
        totals.missed += int((must & ~record.attended).sum())
        indexed, pages = int(stats.num_indexed[0]), int(stats.num_pages[0])
        if indexed:
            totals.candidate_fraction += float(stats.candidates[0].sum()) / indexed
            totals.page_survival += float((pages - stats.pages_skipped[0]).sum()) / pages
        else:
            totals.candidate_fraction += heads
            totals.page_survival += heads
        totals.fallback_steps += int(stats.dense_fallback[0])
        totals.bound_violations += int((dropped > bound + MASS_SLACK).sum())
        self.bounds.append(bound.numpy().copy())
        self.measured.append(dropped.numpy().copy())
        self.context.append(np.full(heads, kv.length, dtype=np.int32))

    def arrays(self) -> dict[str, np.ndarray]:
        """Every (bound, measured, context length) triple so far, one per query-step."""
        cat = lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dtype=dt)  # noqa: E731
        return {"bound": cat(self.bounds, np.float64), "measured": cat(self.measured, np.float64),
                "context": cat(self.context, np.int32)}

    def summary(self) -> dict:
        return {str(k): v.as_dict() for k, v in sorted(self.layers.items())}
