"""The one frozen configuration object of louver-sgl.

Everything that changes what the index stores, how thresholds are chosen, or which path a decode
step takes lives here. Kernel launch parameters (chunk sizes, thread counts, Triton tiles) live in
hardware profiles, not here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from functools import cached_property
from typing import Any

from .policy import ThresholdPolicy

BOUND_FAMILIES = ("grid", "clustered")
CLUSTERINGS = ("kd",)
POLICIES = ("certified", "budget", "fixed", "dense")
CERTIFIED_RULES = ("histogram", "a_posteriori")
GRID_BITS = (2, 4, 8)


@dataclass(frozen=True)
class LouverConfig:
    """Index layout, threshold policy and dispatch knobs.

    Index (both bound-family corners share page_size; see docs/design-notes.md):
      page_size: tokens per KV page; an index is built per full page and KV head.
      family: "grid" (one channel per subspace, per-page lo/scale, ``grid_bits``-bit codes) or
        "clustered" (the paper's index: ``n_subspaces`` contiguous subspaces, balanced clusters of
        ``cluster_size`` tokens per page, centers and radii rounded up).
      grid_bits: code width of the grid family (2, 4 or 8).
      n_subspaces, cluster_size, clustering, residual_norms: knobs of the clustered family;
        ``residual_norms`` stores a per-token ‖k_s − c‖ (rounded up) instead of using the radius.

    Threshold policy (per query head and decode step; T is on the raw dot product q·k):
      policy: "certified" (dropped softmax mass provably < eps), "budget" (sample quantile aiming
        at a fraction ``budget`` of keys), "fixed" (T = ``fixed_threshold``), "dense" (T = −inf).
      eps, budget, fixed_threshold: parameters of those policies.
      certified_passes: how a certified step finds T. 2: a histogram pass over every token bound
        chooses the highest level that fits, then the attend pass gates there. 1: the attend pass
        gates at a provisional level low enough that the mass it drops always fits
        (``threshold.safe_level``) and certifies its own dropped mass; a request whose check
        fails takes the two passes. One pass reads the codes once but keeps more candidates.
      certified_rule: which lower bound on the softmax denominator the certificate divides by.
        "histogram": Z_lb, the exact part's (dense part and sample) alone. "a_posteriori": the
        first level from an estimate of Z (``estimate_share`` times the dense part plus the
        sample scaled to the indexed tokens), then checked against Z_att, the exact mass of
        everything the step attended there. With two passes the first level comes from the
        histogram, and heads whose check fails lower T to the level that fits Z_att and attend
        the band between the two (design notes, "Certified a posteriori"); with one pass the
        provisional level is the safe level at that estimate instead of Z_lb, and a head whose
        check fails is lowered to the safe level at Z_att (design notes, "Certified a
        posteriori in one pass"). Both rules certify; a_posteriori keeps fewer keys.
      estimate_share: the a-posteriori first (or provisional) level's share of the estimated Z
        (above 0, at most 8). The sample scaled to 32K tokens underestimates Z on the captured
        text, so 3 kept the fewest keys there with two passes (docs/results.md); with one pass,
        4-6 keep fewer on text while the check still passes, and where attention is flat
        (random tokens) shares above 4 fail it more often (docs/benchmarks.md, "The a-posteriori
        rule's estimate share"). Lower values run the band pass (or, with one pass, a second
        attend pass) less often but keep more; ``louver-tune`` searches it.
      estimate_share_max: 0 (default) keeps the share at ``estimate_share``. Above it (at most
        32; a-posteriori rule), callers that know their requests (the SGLang backend; the decode
        benchmark's sequence mode) adapt the share per request and layer between 1 and this:
        lowered by √2 after a step with a lowered head, raised by √2 after 16 steps without
        one once a step's bound leaves room (``decode.share_control``). Certification does
        not depend on the share.
      sample_size: exact-scored key sample per request (budget quantile, certified lower bound
        on the softmax denominator).

    Dispatch:
      sink_pages: leading full pages of every request that are always attended densely.
      recent_pages: trailing full pages (before the tail) that are always attended densely.
      dense_fallback_fraction: a request whose candidate fraction exceeds this runs dense. The
        compiled steps (``cpu``, ``triton``) decide it after their sparse pass, so a fallback adds
        a dense step to the sparse one (about 2x the sparse step at 8K and 32K): the default 1.0
        never falls back; below 1 it trades time for dense outputs at high fractions.
      min_sparse_tokens: requests with fewer tokens attend every key densely (no index read);
        short contexts are faster dense. A tuned-profile knob; 0 sends every request through the index.
      value_gate: with the budget and fixed policies, skip V reads for candidates whose exact
        score is below T (their exact mass is added to the reported dropped-mass bound).
    """

    page_size: int = 64
    family: str = "grid"
    grid_bits: int = 8
    n_subspaces: int = 16
    cluster_size: int = 4
    clustering: str = "kd"
    residual_norms: bool = False
    policy: str = "certified"
    eps: float = 1e-3
    budget: float = 0.1
    fixed_threshold: float = 0.0
    certified_passes: int = 2
    certified_rule: str = "histogram"
    estimate_share: float = 3.0
    estimate_share_max: float = 0.0
    sample_size: int = 256
    sink_pages: int = 1
    recent_pages: int = 1
    dense_fallback_fraction: float = 1.0
    min_sparse_tokens: int = 0
    value_gate: bool = True

    def __post_init__(self) -> None:
        _check_int("page_size", self.page_size, 2, 256)
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        _check_choice("family", self.family, BOUND_FAMILIES)
        _check_choice("grid_bits", self.grid_bits, GRID_BITS)
        _check_int("n_subspaces", self.n_subspaces, 1, 1024)
        _check_int("cluster_size", self.cluster_size, 1, self.page_size)
        if self.page_size % self.cluster_size:
            raise ValueError(
                f"page_size ({self.page_size}) must be divisible by cluster_size ({self.cluster_size})"
            )
        clusters = self.page_size // self.cluster_size
        if clusters & (clusters - 1):
            raise ValueError(
                f"page_size / cluster_size must be a power of two (balanced KD split), got {clusters}"
            )
        _check_choice("clustering", self.clustering, CLUSTERINGS)
        _check_choice("policy", self.policy, POLICIES)
        _check_finite("eps", self.eps)
        if not 0.0 < self.eps < 1.0:
            raise ValueError(f"eps must lie in (0, 1), got {self.eps}")
        _check_finite("budget", self.budget)
        if not 0.0 < self.budget <= 1.0:
            raise ValueError(f"budget must lie in (0, 1], got {self.budget}")
        _check_finite("fixed_threshold", self.fixed_threshold)
        _check_choice("certified_passes", self.certified_passes, (1, 2))
        _check_choice("certified_rule", self.certified_rule, CERTIFIED_RULES)
        _check_finite("estimate_share", self.estimate_share)
        if not 0.0 < self.estimate_share <= 8.0:
            raise ValueError(f"estimate_share must lie in (0, 8], got {self.estimate_share}")
        _check_finite("estimate_share_max", self.estimate_share_max)
        if self.estimate_share_max != 0.0 and not self.estimate_share <= self.estimate_share_max <= 32.0:
            raise ValueError(f"estimate_share_max must be 0 (a fixed share) or lie in [estimate_share, 32] = "
                             f"[{self.estimate_share}, 32], got {self.estimate_share_max}")
        _check_int("sample_size", self.sample_size, 1, 1 << 20)
        _check_int("sink_pages", self.sink_pages, 0, 1 << 20)
        _check_int("recent_pages", self.recent_pages, 0, 1 << 20)
        _check_finite("dense_fallback_fraction", self.dense_fallback_fraction)
        if not 0.0 < self.dense_fallback_fraction <= 1.0:
            raise ValueError(
                f"dense_fallback_fraction must lie in (0, 1], got {self.dense_fallback_fraction}"
            )
        _check_int("min_sparse_tokens", self.min_sparse_tokens, 0, 1 << 30)

    @cached_property
    def threshold(self) -> ThresholdPolicy:
        """The threshold policy of this config as one object (what every step asks, not the strings)."""
        return ThresholdPolicy.of(self)

    @property
    def adaptive_share(self) -> bool:
        """Whether callers adapt the a-posteriori estimate share per request and layer
        (``estimate_share_max`` above ``estimate_share`` under the a-posteriori rule)."""
        return self.threshold.a_posteriori and self.estimate_share_max > self.estimate_share

    @property
    def grid_codes(self) -> bool:
        """Whether pages carry grid codes (the grid family): the codes the compiled CPU and
        Triton kernels read. The one test of the family outside validation."""
        return self.family == "grid"

    def subspace_width(self, head_dim: int) -> int:
        """Channels per subspace for ``head_dim``; raises if the split is not even."""
        if self.grid_codes:
            return 1
        if head_dim % self.n_subspaces:
            raise ValueError(
                f"head_dim {head_dim} is not divisible by n_subspaces {self.n_subspaces}"
            )
        return head_dim // self.n_subspaces

    def with_(self, **changes: Any) -> "LouverConfig":
        """A validated copy with ``changes`` applied."""
        return replace(self, **changes)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "LouverConfig":
        """Build from a plain dict, rejecting unknown keys by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown louver config keys {unknown}; known keys: {sorted(known)}")
        return cls(**values)


def _check_int(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must lie in [{lo}, {hi}], got {value}")


def _check_finite(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
