"""What every decode implementation shares: the request layout, the threshold edges, the value
gate, the plan and the step statistics.

This module imports nothing of the implementations (torch, compiled CPU, Triton), and they import
it rather than each other. The numbers that the compiled kernels must agree on (edges, margins)
are data here and are passed to the C++ and Triton kernels from these objects, so that a config
means the same on every implementation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, TypeVar

import torch

from ..config import LouverConfig

if TYPE_CHECKING:
    from ..index.store import PageIndexStore

_T = TypeVar("_T")


# ----- request layout ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestLayout:
    """How a request's tokens split into densely attended and indexed parts.

    A request with L tokens has full pages 0..L//P−1 and a tail of L mod P tokens (never indexed).
    The first ``sink_pages`` and the last ``recent_pages`` full pages are attended densely with the
    tail; the other full pages are read through the index. A request with fewer than
    ``min_sparse_tokens`` tokens attends every key densely.
    """

    page_size: int
    sink_pages: int
    recent_pages: int
    min_sparse_tokens: int

    @classmethod
    def of(cls, config: LouverConfig) -> "RequestLayout":
        return cls(config.page_size, config.sink_pages, config.recent_pages, config.min_sparse_tokens)

    def constexprs(self) -> dict:
        """The layout as the Triton kernels' constexprs (``P``, ``SINK``, ``RECENT``; the
        ``min_sparse_tokens`` test is a runtime argument)."""
        return dict(P=self.page_size, SINK=self.sink_pages, RECENT=self.recent_pages)

    def split(self, num_tokens: int) -> tuple[range, range, range]:
        """(sink pages, indexed pages, recent pages) of one request as page-index ranges."""
        full = num_tokens // self.page_size
        if num_tokens < self.min_sparse_tokens:  # short request: every full page is attended densely
            return range(0, full), range(full, full), range(full, full)
        sink = min(self.sink_pages, full)
        recent = min(self.recent_pages, full - sink)
        return range(0, sink), range(sink, full - recent), range(full - recent, full)

    def indexed_pages(self, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Device-side ``split``: (first indexed page, end of indexed pages) ``[B]`` int64 of every
        request of ``seq_lens`` ``[B]`` (no host read)."""
        lens = seq_lens.long()
        full = lens // self.page_size
        sink = torch.clamp(full, max=self.sink_pages)
        end = full - torch.minimum(full - sink, torch.full_like(full, self.recent_pages))
        short = lens < self.min_sparse_tokens
        return torch.where(short, full, sink), torch.where(short, full, end)

    def indexed_tokens(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """Tokens read through the index per request ``[B]`` int64 (device-side)."""
        first, end = self.indexed_pages(seq_lens)
        return (end - first) * self.page_size


# ----- threshold edges and the value gate ---------------------------------------------------------


@dataclass(frozen=True)
class ThresholdEdges:
    """The fixed levels a certified threshold is chosen from, in units of σ·(T − ref).

    Edge j is ``low + step·j`` for j < ``count``. A unit's bin is the number of edges <= its
    σ·(bound − ref) (NaN: past the last edge); the certified histograms have ``count + 2`` bins.
    T is placed ``margin`` (σ·score units) under its edge and rounded down to fp32, so a unit
    strictly below the edge in fp64 stays below the fp32 T.
    """

    low: float = -48.0
    step: float = 0.25
    count: int = 257
    margin: float = 1e-6

    @property
    def hist_width(self) -> int:
        return self.count + 2

    def values(self) -> torch.Tensor:
        """The edges ``[count]`` fp64."""
        return self.low + self.step * torch.arange(self.count, dtype=torch.float64)

    def kernel_args(self) -> dict:
        """The edges as the compiled kernels' named arguments."""
        return {"edge_low": self.low, "edge_step": self.step, "edge_count": self.count, "edge_margin": self.margin}


EDGES = ThresholdEdges()
# Relative safety on certified budgets for the fp64 accumulation of up to ~1e8 positive terms.
BUDGET_SAFETY = 1.0 - 1e-7
# Relative bound on the fp64 rounding of the certified histograms' sums (terms added in any order,
# then a cumulative sum): 2·n·2^-53 with n < 2·10^7 terms per (request, head).
HIST_ROUNDING = 1e-8
# Lowering of an fp64 sum of positive lower-bound terms for its rounding (n·2^-53 < 1e-9 for up to
# 9·10^6 terms): Z_lb and Z_att take it, in every implementation.
FP64_SUM_DOWN = 1.0 - 1e-9


@dataclass(frozen=True)
class ValueGate:
    """The value gate's margin: a candidate skips its V read only if its exact score is below
    T − ``rel``·(|T| + 1), clearly below T, so that two evaluation orders of the same dot product
    (torch, C++, Triton) gate the same keys."""

    rel: float = 1e-4

    def threshold(self, t: torch.Tensor) -> torch.Tensor:
        """The gate level ``[...]`` fp32 of thresholds ``t`` (fp32, any shape)."""
        return t - self.rel * (t.abs() + 1.0)


VALUE_GATE = ValueGate()


# ----- the plan --------------------------------------------------------------------------------


@dataclass
class DecodePlan:
    """Flat index lists of one decode batch (all int64 on the KV device; ``plan.plan_decode``).

    dense_slots/dense_req ``[ND]``; page_ids/page_req ``[NP]``; sample_slots/sample_req ``[NS]``;
    num_indexed ``[B]`` indexed tokens per request; num_pages ``[B]`` indexed pages per request (also
    as the host list ``pages_per_request``); samples_per_request ``[B]``; seq_lens ``[B]``;
    page_table ``[B, max_pages]`` as planned.
    """

    batch_size: int
    page_size: int
    dense_slots: torch.Tensor
    dense_req: torch.Tensor
    page_ids: torch.Tensor
    page_req: torch.Tensor
    sample_slots: torch.Tensor
    sample_req: torch.Tensor
    num_indexed: torch.Tensor
    num_pages: torch.Tensor
    samples_per_request: torch.Tensor
    seq_lens: torch.Tensor
    pages_per_request: tuple[int, ...]
    page_table: torch.Tensor | None = None
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    def cached(self, key: tuple, make: Callable[[], _T]) -> _T:
        """``make()``, built once per plan and ``key``: host data derived from the plan (kernel task
        lists) and step buffers sized by it, shared by every layer's step of a forward pass."""
        if key not in self.derived:
            self.derived[key] = make()
        return self.derived[key]


@dataclass
class ExactPart:
    """Exact scores computed before filtering: dense part ``s_dense`` ``[ND, H_q]``; ``ref`` (max
    exact score, fp32), ``z_dense`` and ``z_lb`` (fp64 masses relative to ref) ``[B, H_q]``;
    ``sample`` = (padded sample scores ``[B, M, H_q]``, counts ``[B]``)."""

    s_dense: torch.Tensor
    ref: torch.Tensor
    z_dense: torch.Tensor
    z_lb: torch.Tensor
    sample: tuple[torch.Tensor, torch.Tensor]


# ----- step statistics ---------------------------------------------------------------------------


@dataclass
class StepStats:
    """Per-step telemetry, the same fields on every implementation. Shapes: ``[B, H_q]`` unless noted.

    threshold (fp32), candidates (indexed keys attended per head; all under a dense fallback),
    pages_skipped, mass_bound (fp64 certified upper bound on the dropped softmax mass; 0 under a
    dense fallback), num_indexed ``[B]``, num_pages ``[B]``, dense_fallback ``[B]`` bool,
    values_read ``[B]`` (V rows read for indexed keys, all KV heads), union_candidates ``[B]``
    (candidate rows over all KV heads: keys read), pages_read ``[B]`` (indexed pages whose codes
    were read because some head kept the page), lowered (bool: heads whose first level failed
    its check and were set again: the one-pass rule's and the a-posteriori rules' checks; never
    under the other policies; each implementation checks its own bounds, so two can differ). A
    dense fallback is decided by union_candidates (more than ``dense_fallback_fraction`` of
    num_indexed · H_kv); such a request reads every V row (values_read = num_indexed · H_kv), its
    union_candidates and pages_read stay the filter's.
    """

    threshold: torch.Tensor
    candidates: torch.Tensor
    pages_skipped: torch.Tensor
    mass_bound: torch.Tensor
    num_indexed: torch.Tensor
    num_pages: torch.Tensor
    dense_fallback: torch.Tensor
    values_read: torch.Tensor
    union_candidates: torch.Tensor
    pages_read: torch.Tensor
    lowered: torch.Tensor

    @classmethod
    def from_packed(cls, packed: torch.Tensor, num_indexed: torch.Tensor, num_pages: torch.Tensor) -> "StepStats":
        """Statistics of the compiled step, packed as fp64 ``[B, H_q + 1, 5]`` (row h < H_q: head h's
        threshold, candidates, pages skipped, mass bound, lowered 0/1; row H_q: the request's dense
        fallback 0/1, union candidates, values read, pages read; kernels/cpu/stats.h). The fields are unpacked on
        first access: a step then creates one tensor for its statistics, not eight (at batch 1
        each costs microseconds once a layer has swept the caches)."""
        stats = cls.__new__(cls)
        stats.__dict__.update(_packed=packed, num_indexed=num_indexed, num_pages=num_pages)
        return stats

    @property
    def rows(self) -> int:
        """The batch size B, read without unpacking a packed instance."""
        packed = self.packed
        return int(packed.shape[0]) if packed is not None else int(self.candidates.shape[0])

    @property
    def packed(self) -> torch.Tensor | None:
        """The compiled step's fp64 ``[B, H_q + 1, 5]`` statistics while no field has been read
        (``from_packed``), else None."""
        return self.__dict__.get("_packed")

    def packed_checks(self, bound_below: float) -> tuple[list[bool], list[bool]]:
        """Of a packed instance (``packed`` not None), per request: whether some head was lowered
        by its check, and whether every head's mass bound lies below ``bound_below`` (NaN: not
        below). One host copy, no tensor unpacked (the share control reads it every layer)."""
        heads = [r[:-1] for r in self.packed.tolist()]  # per request, per head its five columns
        return ([any(h[_LOWERED] != 0 for h in r) for r in heads],
                [all(h[_MASS_BOUND] < bound_below for h in r) for r in heads])

    @classmethod
    def concat_packed(cls, steps: list["StepStats"]) -> "StepStats":
        """Steps of the compiled implementation with equal H_q (``packed`` not None) as one
        ``StepStats`` over their rows, in order: three concatenations, unpacked once."""
        return cls.from_packed(torch.cat([s.packed for s in steps]), torch.cat([s.num_indexed for s in steps]),
                               torch.cat([s.num_pages for s in steps]))

    def __getattr__(self, name: str):
        # only reached for attributes not yet set: the fields of a packed instance
        packed = self.__dict__.get("_packed")
        if packed is None or name not in _PACKED_FIELDS:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        heads = packed.shape[1] - 1
        if name == "lowered":  # read alone (a benchmark's count of lowered requests): the rest stays packed
            self.__dict__["lowered"] = packed[:, :heads, _LOWERED] != 0
            return self.__dict__["lowered"]
        per_head, per_req = packed[:, :heads], packed[:, heads]
        self.__dict__.update(
            threshold=per_head[..., 0].float(), candidates=per_head[..., 1].long(),
            pages_skipped=per_head[..., 2].long(), mass_bound=per_head[..., _MASS_BOUND].contiguous(),
            dense_fallback=per_req[:, 0] != 0, union_candidates=per_req[:, 1].long(),
            values_read=per_req[:, 2].long(), pages_read=per_req[:, 3].long())
        self.__dict__.setdefault("lowered", per_head[..., _LOWERED] != 0)
        del self.__dict__["_packed"]
        return self.__dict__[name]


# columns of a head's row in the packed statistics (from_packed; kernels/cpu/stats.h) that are
# read on their own: by packed_checks and by an unpacking of ``lowered`` alone
_MASS_BOUND, _LOWERED = 3, 4
_PACKED_FIELDS = frozenset(("threshold", "candidates", "pages_skipped", "mass_bound", "dense_fallback",
                            "union_candidates", "values_read", "pages_read", "lowered"))


# ----- the implementation interface --------------------------------------------------------------


@dataclass(frozen=True)
class HeadShapes:
    """Attention shapes a wrapper is built for: query heads, KV heads, key and value head dims."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int

    def __post_init__(self) -> None:
        if min(self.num_q_heads, self.num_kv_heads, self.head_dim, self.head_dim_v) < 1:
            raise ValueError(f"head shapes must be positive, got {self}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")


@dataclass(frozen=True)
class Capacity:
    """Fixed capacities of a plan: at most ``max_batch`` requests with page tables at most
    ``max_pages`` wide (None: whatever each plan needs; a plan then may allocate)."""

    max_batch: int | None = None
    max_pages: int | None = None

    def check(self, batch: int, pages: int) -> None:
        """Raise ``ValueError`` naming the limit a batch of ``batch`` requests and ``pages`` pages exceeds."""
        if self.max_batch is not None and batch > self.max_batch:
            raise ValueError(f"the batch has {batch} requests, more than max_batch={self.max_batch}")
        if self.max_pages is not None and pages > self.max_pages:
            raise ValueError(f"the page table is {pages} pages wide, more than max_pages={self.max_pages}")


@dataclass(frozen=True)
class DecodeResult:
    """What one decode step returns (``LouverDecode.run``).

    out: ``[B, H_q, D_v]`` in q's dtype (the caller's ``out`` buffer when it passed one).
    stats: the step's ``StepStats`` when asked for (``stats=True`` or ``attended=True``), else None.
    attended: with ``attended=True``, per request the bool ``[H_q, L]`` set of keys the step
        attended (L: the request's tokens), else None.
    """

    out: torch.Tensor
    stats: StepStats | None = None
    attended: list[torch.Tensor] | None = None


class DecodeImplementation:
    """One implementation of the decode step behind ``api.LouverDecode``.

    Subclasses set ``name``, and override ``unavailable`` (why it cannot run on a device, or None)
    and ``check_config`` (``ValueError`` naming the first option whose meaning it cannot honour).
    ``plan`` is host-side and may allocate; ``run`` reads the plan and returns a ``DecodeResult``
    (stats at least when asked for, attended only where ``returns_attended``).
    """

    name: str = ""
    returns_attended: bool = False  # whether run can return the attended key set
    takes_shares: bool = False  # whether run takes an estimate share per request (estimate_share)
    # whether tokens are gated (and certified) with the int8 token bounds of
    # ``reference_compiled.int8_token_bounds_reference`` instead of the store's fp32 ones
    int8_token_bounds: bool = False

    def __init__(self, config: LouverConfig, device: torch.device, launch, shapes: HeadShapes | None,
                 capacity: Capacity) -> None:
        self.config, self.device, self.shapes, self.capacity = config, device, shapes, capacity

    @classmethod
    def unavailable(cls, device: torch.device) -> str | None:
        return None

    @classmethod
    def check_config(cls, config: LouverConfig, device: torch.device) -> None:
        return None

    @classmethod
    def reject(cls, option: str, value, why: str) -> None:
        """Raise the error of an option this implementation cannot honour."""
        raise ValueError(f"{option}={value!r} is not supported by the {cls.name!r} decode implementation: {why}")

    def plan(self, page_table: torch.Tensor, seq_lens: torch.Tensor):
        raise NotImplementedError

    def run(self, plan, *, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, store: PageIndexStore,
            sigma: float, out: torch.Tensor | None = None, stats: bool = False,
            attended: bool = False, **shares) -> DecodeResult:
        """One step of ``plan`` for one layer: arguments as ``LouverDecode.run`` (``estimate_share``
        only where ``takes_shares``)."""
        raise NotImplementedError


def check_shares(shares: torch.Tensor, batch: int, config: LouverConfig) -> None:
    """An estimate share per request (``LouverDecode.run``'s ``estimate_share``): fp64 ``[B]`` on
    the CPU, for a policy whose certified rule is a posteriori (the only one that reads it). Reads
    no tensor value (a step's host time counts at batch 1): the implementations check the values
    (``check_share_values``; the compiled step in its kernel)."""
    if not config.threshold.a_posteriori:
        raise ValueError("estimate_share per request is for certified_rule='a_posteriori'; this policy is "
                         f"{config.policy!r} ({config.certified_rule!r} rule)")
    if not isinstance(shares, torch.Tensor) or shares.dtype != torch.float64 or shares.device.type != "cpu" \
            or tuple(shares.shape) != (batch,):
        raise ValueError(f"estimate_share must be a float64 CPU tensor [B] = [{batch}], got "
                         f"{getattr(shares, 'dtype', type(shares).__name__)} {tuple(getattr(shares, 'shape', ()))}")


def check_share_values(shares: torch.Tensor) -> None:
    """Every estimate share positive and finite."""
    if not bool(((shares > 0) & torch.isfinite(shares)).all()):
        raise ValueError(f"estimate_share must be positive and finite, got {shares.tolist()}")


def check_inputs(q, k_cache, v_cache, store, config: LouverConfig) -> None:
    """Shapes of a step's tensors against each other, the index and the config's index layout."""
    qs, ks, vs = q.shape, k_cache.shape, v_cache.shape
    if len(qs) != 3 or len(ks) != 3 or len(vs) != 3:
        raise ValueError(
            f"q must be [B, H_q, D] and k/v caches [slots, H_kv, D]; got {tuple(qs)}, {tuple(ks)}, {tuple(vs)}"
        )
    if ks[:2] != vs[:2] or ks[1:] != (store.num_kv_heads, store.head_dim):
        raise ValueError("k/v caches do not match each other or the index (H_kv, D)")
    if qs[2] != store.head_dim or qs[1] % store.num_kv_heads:
        raise ValueError(f"q {tuple(qs)} does not match H_kv={store.num_kv_heads}, D={store.head_dim}")
    if config is not store.config and any(getattr(config, f) != getattr(store.config, f) for f in INDEX_LAYOUT):
        raise ValueError("config index layout differs from the store's; rebuild the index")


INDEX_LAYOUT = ("page_size", "family", "grid_bits", "n_subspaces", "cluster_size", "residual_norms")
