"""The ``cpu`` decode implementation: the compiled CPU kernels for the grid family.

The compiled attend pass does, per (request, chunk of pages) task and for every KV head, the page
bounds, token bounds, the GQA-union candidate gate, exact scores from candidate keys, the value
gate, an online softmax and the dropped-mass accounting; the chunks' partial softmax states are
then merged with the dense part. A step runs all of it (exact part and T included), the step
statistics and the output conversion as one call, ``LayerStep.run``, over a layer side made once
per layer (``CompiledLayer``) and a plan side made once per forward pass (``StepPlan``). Certified
steps choose T between the exact part and the attend pass by one compiled pass over every page's
codes (``certified_threshold``: the histogram of all token bounds, the int8 ones the attend pass
gates with; the rule is ``threshold.certified_choice``); over 8-bit codes that pass also keeps
every token reaching the safe level in a reserve, which the attend pass reads instead of the codes
(``CpuLaunch.one_scan``, ``run_scan_pass``). Every compiled phase has its torch specification in
reference_compiled.py, impl_torch.py or threshold.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ..config import LouverConfig
from ..index.store import PageIndexStore
from ..settings import Environment
from . import threshold as th
from .contract import (
    EDGES, VALUE_GATE, DecodeImplementation, DecodePlan, DecodeResult, ExactPart, RequestLayout, StepStats,
    check_inputs,
)
from .plan import plan_decode


@dataclass(frozen=True)
class CpuLaunch:
    """Launch parameters of the compiled CPU step (profile values; ``louver-tune`` searches them).

    chunk_pages: most pages one task of the attend pass takes (split-K granularity).
    one_scan: certified steps of the histogram rule over 8-bit codes read them once: the pass that
      builds the histogram also keeps every token whose bound reaches the safe level (the lowest
      level the rule can choose) in a reserve, and the attend pass reads the reserve at the chosen
      T instead of the codes (design notes, "Certified in one code pass"). Same T, keys and
      certificate as the two scans (False), up to the histogram's fp64 rounding. Over 4-bit codes
      the step keeps its two scans: their second scan reads half the bytes and their looser
      bounds fill a larger reserve, and one scan measured slower there (docs/benchmarks.md,
      "Certified in one scan and residual weights").
    reserve_offset: where the one-scan reserve starts, in threshold edges (σ·0.25) from the safe
      level's edge. −1 (default) leaves one edge of margin: the rule's edge never lies below it.
      Higher offsets keep a smaller reserve, and a request with a head whose edge lies below its
      reserve level takes the two scans.
    residual_weights: token bounds with residual int8 weights (a second integer dot per token
      against the residual of the first int8 rounding, ``quantize_weights_residual``): their int8
      slack shrinks about 250-fold, so as few keys pass as with the store's fp32 bounds (GQA
      groups of at most 4; larger ones keep one dot). Every bound is sound either way; the choice
      is speed: on the 2-core AMD EPYC (AVX-512) the second dot cost more than the keys it saved
      (docs/benchmarks.md, "Certified in one scan and residual weights"), so it is off by default
      and a profile knob.
    """

    chunk_pages: int = 64
    one_scan: bool = True
    reserve_offset: int = -1
    residual_weights: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.chunk_pages, bool) or not isinstance(self.chunk_pages, int) or self.chunk_pages < 1:
            raise ValueError(f"chunk_pages must be a positive int, got {self.chunk_pages!r}")
        for name in ("one_scan", "residual_weights"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if isinstance(self.reserve_offset, bool) or not isinstance(self.reserve_offset, int) \
                or not -256 <= self.reserve_offset <= 256:
            raise ValueError(f"reserve_offset must be an int in [-256, 256], got {self.reserve_offset!r}")

    @classmethod
    def of(cls, launch: "CpuLaunch | Mapping[str, Any] | None") -> "CpuLaunch":
        if launch is None:
            return cls()
        if isinstance(launch, cls):
            return launch
        known = {"chunk_pages", "one_scan", "reserve_offset", "residual_weights"}
        unknown = sorted(set(launch) - known)
        if unknown:
            raise ValueError(f"unknown CPU launch parameters {unknown}; known: {sorted(known)}")
        return cls(**dict(launch))


@functools.cache
def compiled_ops():
    """The compiled CPU module, or None where it does not build here (resolved once; the cache
    directory and the off switch are ``LOUVER_KERNEL_CACHE`` and ``LOUVER_DISABLE_CPU_KERNELS``)."""
    from louver_kernels.cpu_ops import cpu_ops_available, load_cpu_ops

    env = Environment.read()
    if not cpu_ops_available(env.kernel_cache_dir, env.disable_cpu_kernels):
        return None
    return load_cpu_ops(env.kernel_cache_dir)


class CpuDecode(DecodeImplementation):
    """The compiled CPU kernels (grid family, CPU tensors): one compiled call per layer and step."""

    name = "cpu"
    int8_token_bounds = True
    returns_attended = True  # debug only: the attend pass writes the set it attended
    takes_shares = True

    def __init__(self, config, device, launch, shapes, capacity) -> None:
        super().__init__(config, device, launch, shapes, capacity)
        self.launch = CpuLaunch.of(launch)
        self.ops = compiled_ops()
        # compiled layer sides by (id(k_cache), id(v_cache), id(store), sigma); each keeps its
        # tensors alive, so the ids stay theirs while the entry lives
        self.layers: dict[tuple, CompiledLayer] = {}

    @classmethod
    def unavailable(cls, device: torch.device) -> str | None:
        if device.type != "cpu":
            return "it runs on CPU tensors"
        if compiled_ops() is not None:
            return None
        from louver_kernels.cpu_ops import cpu_ops_build_error

        why = cpu_ops_build_error(Environment.read().kernel_cache_dir) or "see the log"
        return f"the compiled CPU kernels did not build or load: {why}"

    @classmethod
    def check_config(cls, config: LouverConfig, device: torch.device) -> None:
        if not config.grid_codes:
            cls.reject("family", config.family, "the compiled kernels read grid codes; use impl='torch'")

    def plan(self, page_table: torch.Tensor, seq_lens: torch.Tensor) -> DecodePlan:
        self.capacity.check(page_table.shape[0], page_table.shape[1])
        plan = plan_decode(page_table, seq_lens, self.config)
        if self.shapes is not None:  # the plan side now, so that run allocates nothing
            self._plan_side(plan, self.shapes.num_q_heads, self.shapes.num_kv_heads, self.shapes.head_dim,
                            self.shapes.head_dim_v)
        return plan

    def run(self, plan: DecodePlan, *, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            store: PageIndexStore, sigma: float, out: torch.Tensor | None = None, stats: bool = False,
            attended: bool = False, estimate_share: torch.Tensor | None = None) -> DecodeResult:
        layer = self.layers.get((id(k_cache), id(v_cache), id(store), sigma))
        if layer is None:
            layer = self._layer(plan, q, k_cache, v_cache, store, sigma)
        side = plan.derived.get(layer.plan_key)
        if side is None:
            side = self._plan_side(plan, q.shape[1], k_cache.shape[1], q.shape[2], v_cache.shape[2])
        if not attended:
            out, step_stats = layer.run(q, plan, side, out, share=estimate_share)
            return DecodeResult(out, step_stats)
        keep = torch.empty(len(plan.page_ids), plan.page_size, q.shape[1], dtype=torch.uint8)
        out, step_stats = layer.run(q, plan, side, out, keep, estimate_share)
        return DecodeResult(out, step_stats, attended_masks(keep, plan, self.config))

    def _layer(self, plan: DecodePlan, q, k_cache, v_cache, store, sigma: float) -> "CompiledLayer":
        """The layer side of a layer's first step (its inputs checked here; later steps only by the kernel)."""
        check_inputs(q, k_cache, v_cache, store, self.config)
        if not store.config.grid_codes:
            raise ValueError("the 'cpu' decode implementation reads grid-family stores")
        if plan.page_size != self.config.page_size:
            raise ValueError(f"plan is for page size {plan.page_size}, the step for {self.config.page_size}")
        if len(self.layers) >= MAX_COMPILED_LAYERS:  # entries keep their KV caches alive
            self.layers.clear()
        key = self._plan_key(q.shape[1], k_cache.shape[1], q.shape[2], v_cache.shape[2])
        layer = CompiledLayer(self.ops, k_cache, v_cache, store, sigma, self.config, key, self._kernel_launch)
        self.layers[(id(k_cache), id(v_cache), id(store), sigma)] = layer
        return layer

    @property
    def _kernel_launch(self) -> dict:
        """The launch values the compiled ``LayerStep`` takes (``_layer_step``)."""
        return dict(one_scan=self._one_scan, reserve_offset=self.launch.reserve_offset,
                    residual_weights=self.launch.residual_weights)

    @property
    def _one_scan(self) -> bool:
        """Whether this step's certified histogram rule runs in one scan (CpuLaunch.one_scan)."""
        policy = self.config.threshold
        return (self.launch.one_scan and self.config.grid_bits == 8 and policy.certified and not policy.one_pass
                and not policy.a_posteriori)

    def _plan_key(self, heads: int, h_kv: int, dim: int, d_v: int) -> tuple:
        return ("cpu_step", self.launch.chunk_pages, torch.get_num_threads(), heads, h_kv, dim, d_v,
                self.config.sample_size, self.config.threshold.band_pass or self._one_scan)

    def _plan_side(self, plan: DecodePlan, heads: int, h_kv: int, dim: int, d_v: int):
        """The plan side ``(part, q32, ops.StepPlan)`` for these shapes, made once per plan."""
        key = self._plan_key(heads, h_kv, dim, d_v)

        def make():
            chunks = page_chunks(plan, self.launch.chunk_pages)
            reserve = self.config.threshold.band_pass or self._one_scan
            band = (len(plan.page_ids), plan.page_size) if reserve else None
            part = _Outputs(plan.batch_size, heads, h_kv, d_v, len(chunks[0]), len(plan.dense_slots),
                            self.config.sample_size, band=band)
            return _step_plan(self.ops, plan, chunks, part, dim)

        return plan.cached(key, make)


def page_chunks(plan: DecodePlan, chunk_pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split each request's page rows into chunks: (chunk_req, begin, end) ``[NC]`` int64.

    One chunk is one task of the kernel's shared task counter. Chunk sizes shrink towards the end
    of the batch (guided scheduling): a chunk takes at most ``chunk_pages`` pages and at most
    1/(GUIDED_SHARE · threads) of the pages left, so the first tasks are large (few partial states
    to merge) and the last ones single pages (the cores finish together). Host-side planning over
    the plan's page counts (a few requests: plain lists are cheaper than a dozen small tensor ops).
    """
    share = GUIDED_SHARE * torch.get_num_threads()
    left = sum(plan.pages_per_request)
    req, begin, end = [], [], []
    start = 0
    for b, count in enumerate(plan.pages_per_request):
        first, stop = start, start + count
        while first < stop:
            size = max(1, min(chunk_pages, -(-left // share), stop - first))
            req.append(b)
            begin.append(first)
            end.append(first + size)
            first += size
            left -= size
        start = stop
    as_tensor = lambda x: torch.tensor(x, dtype=torch.long)
    return as_tensor(req), as_tensor(begin), as_tensor(end)


# A chunk takes at most 1/(GUIDED_SHARE · threads) of the pages left: against an even split into 16
# chunks per thread this measured 5-8 % faster at 32K, batch 1 (less waiting at the end).
GUIDED_SHARE = 2


def _layer_step(ops, k_cache, v_cache, store: PageIndexStore, sigma: float, config: LouverConfig,
                launch: dict | None = None):
    """The compiled ``LayerStep`` of ``config``'s policy over a layer's caches and index; ``launch``:
    its ``one_scan``, ``reserve_offset`` and ``residual_weights`` (``CpuDecode._kernel_launch``;
    default: two scans, no residual weights)."""
    launch = {"one_scan": False, "reserve_offset": -1, "residual_weights": False, **(launch or {})}
    policy = config.threshold
    t_static = policy.static_threshold
    meta = store.tensors
    return ops.LayerStep(
        k_cache=k_cache, v_cache=v_cache, lo=meta["lo"], scale=meta["scale"], radius=meta["radius"],
        codes=meta["codes"], sigma=float(sigma), budget=policy.kernel_budget(),
        t_fixed=0.0 if t_static is None else t_static, value_gate=policy.gates_values, gate_rel=VALUE_GATE.rel,
        bits=store.config.grid_bits, page_size=store.page_size,
        fallback_fraction=float(config.dense_fallback_fraction),
        eps_budget=policy.kernel_eps_budget(th.BUDGET_SAFETY), rounding=th.HIST_ROUNDING,
        one_pass=policy.one_pass, a_posteriori=policy.a_posteriori, estimate_share=policy.estimate_share,
        **launch, **EDGES.kernel_args())


def _dense_fallback(dense_layer, q, cpu: tuple, stats: StepStats, out: torch.Tensor, plan: DecodePlan,
                    keep: torch.Tensor | None) -> None:
    """Rows of ``out`` of the requests over the fallback fraction replaced by the dense policy's
    compiled step on the same plan (its buffers are free again once ``out`` and the statistics are
    written). The torch dense path gathered and widened every K and V row: a certified step at 32K
    that falls back took 26 ms with it, 5.1 ms with this. With ``keep`` (the debug attended set)
    those requests' page rows take the dense step's own set."""
    dense_keep = None if keep is None else torch.empty_like(keep)
    dense_out, _, _ = dense_layer.run(q, cpu[2], None, dense_keep)
    rows = stats.dense_fallback
    out[rows] = dense_out[rows]
    if keep is not None:
        fallen = rows.to(plan.page_req.device)[plan.page_req]
        keep[fallen] = dense_keep[fallen]


def attended_masks(keep: torch.Tensor, plan: DecodePlan, config: LouverConfig) -> list[torch.Tensor]:
    """Per request, bool ``[H_q, L]`` from the compiled step's attended buffer ``[NP, P, H_q]``
    u8 (page rows as in ``plan.page_ids``): the dense part (the layout's, attended exactly by the
    exact part) and, over the indexed pages, what the attend pass itself marked."""
    layout = RequestLayout.of(config)
    size, heads = plan.page_size, keep.shape[2]
    masks = []
    for b, n in enumerate(plan.seq_lens.tolist()):
        mask = torch.ones(heads, n, dtype=torch.bool)
        indexed = layout.split(n)[1]
        rows = keep[plan.page_req == b]  # [pages of b in order, P, H_q]
        assert len(rows) == len(indexed), "the plan's page rows differ from the layout's indexed pages"
        mask[:, indexed.start * size: indexed.stop * size] = rows.reshape(-1, heads).t().bool()
        masks.append(mask)
    return masks


# Compiled layer sides one implementation keeps (each keeps its KV caches alive; a server has one
# per layer).
MAX_COMPILED_LAYERS = 256


class CompiledLayer:
    """One layer's compiled one-call step: the layer side (``ops.LayerStep``: KV caches, index,
    policy scalars; and the dense policy's for fallbacks) and the key of the plan side it runs on
    (``StepPlan`` in ``plan.derived``). Made by a layer's first step; ``CpuDecode`` keeps it so that
    later steps skip straight to ``run``."""

    __slots__ = ("layer", "dense_layer", "plan_key", "k_cache", "v_cache", "store", "sigma")

    def __init__(self, ops, k_cache, v_cache, store: PageIndexStore, sigma: float, config: LouverConfig,
                 plan_key: tuple, launch: dict | None = None):
        self.layer = _layer_step(ops, k_cache, v_cache, store, sigma, config, launch)
        # the dense policy's step (T = −inf: every key a candidate and attended) for fallbacks; a
        # dense-policy layer needs none, its own step already attends every key
        dense = config.with_(policy="dense", dense_fallback_fraction=1.0)
        self.dense_layer = None if config.threshold.dense else _layer_step(ops, k_cache, v_cache, store, sigma,
                                                                             dense)
        # the caches and the store stay referenced: the implementation's key holds their id()s,
        # which must not be reused while the entry lives
        self.plan_key, self.k_cache, self.v_cache, self.store, self.sigma = plan_key, k_cache, v_cache, store, sigma

    def run(self, q, plan: DecodePlan, cpu: tuple, out=None, keep: torch.Tensor | None = None,
            share: torch.Tensor | None = None):
        """One step: ``(out [B, H_q, D_v] in q's dtype, StepStats)``; ``cpu`` is
        ``plan.derived[self.plan_key]``. Requests over the fallback fraction get dense attention.
        ``keep`` (debug only): a u8 ``[NP, P, H_q]`` buffer the step fills with its attended set.
        ``share``: the a-posteriori estimate share per request ``[B]`` fp64 (None: the policy's)."""
        out, packed, any_fallback = self.layer.run(q, cpu[2], out, keep, share)
        stats = StepStats.from_packed(packed, plan.num_indexed, plan.num_pages)
        if any_fallback and self.dense_layer is not None:
            _dense_fallback(self.dense_layer, q, cpu, stats, out, plan, keep)
        return out, stats


def _step_plan(ops, plan: DecodePlan, chunks: tuple, part: "_Outputs", dim: int):
    """The plan side of ``CompiledLayer.run``: (part, q32 ``[B, H_q, D]`` fp32, ``ops.StepPlan``)."""
    batch, heads = part.ref.shape
    q32 = torch.empty(batch, heads, dim)
    chunk_req, chunk_begin, chunk_end = chunks
    step_plan = ops.StepPlan(
        dense_slots=plan.dense_slots, dense_req=plan.dense_req, sample_slots=plan.sample_slots,
        sample_req=plan.sample_req, page_ids=plan.page_ids, chunk_req=chunk_req, chunk_begin=chunk_begin,
        chunk_end=chunk_end, num_indexed=plan.num_indexed, page_req=plan.page_req, q32=q32, **part.named())
    return part, q32, step_plan


class _Outputs:
    """The compiled step's output buffers (made once per plan, see ``CpuDecode``; shapes in the op
    comments)."""

    def __init__(self, batch, heads, h_kv, d_v, n_chunks, n_dense, sample_size, band: tuple | None = None):
        groups = heads // h_kv
        self.s_dense = torch.empty(n_dense, heads)
        self.sample = torch.empty(batch, sample_size, heads)
        self.ref = torch.empty(batch, heads)
        self.z = torch.empty(batch, heads, 2, dtype=torch.float64)
        self.t = torch.empty(batch, heads)
        self.gate = torch.empty(batch, heads)
        self.m = torch.empty(n_chunks, h_kv, groups)
        self.l = torch.empty(n_chunks, h_kv, groups)
        self.o = torch.empty(n_chunks, h_kv, groups, d_v)
        self.counts = torch.empty(n_chunks, h_kv, 2 * groups + 3, dtype=torch.long)
        self.mass = torch.empty(n_chunks, h_kv, groups, 3, dtype=torch.float64)
        self.result = torch.empty(batch, heads, d_v)
        self.per_head = torch.empty(batch, heads, 2, dtype=torch.long)
        self.per_req = torch.empty(batch, 3, dtype=torch.long)
        self.masses = torch.empty(batch, heads, 3, dtype=torch.float64)
        width = EDGES.hist_width
        self.hist = torch.empty(batch, heads, width, dtype=torch.float64)
        self.habs = torch.empty(batch, heads, width, dtype=torch.float64)
        self.certificate = torch.empty(batch, heads, dtype=torch.float64)
        self.z_lb = torch.empty(batch, heads, dtype=torch.float64)
        # the a-posteriori band pass (band = (page rows, page size), else None): its chunk states,
        # the first pass's page bounds and its reserve (ops.h, StepPlan; empty without it)
        like = lambda x: torch.empty_like(x) if band else x.new_empty(0)
        self.band_m, self.band_l, self.band_o = like(self.m), like(self.l), like(self.o)
        self.band_counts, self.band_mass = like(self.counts), like(self.mass)
        rows, size = band or (0, 0)
        entries = rows * size * h_kv
        self.band_pb = torch.empty(rows, heads)
        self.band_mag = torch.empty(rows, heads)
        self.reserve_slot = torch.empty(entries, dtype=torch.long)
        self.reserve_pos = torch.empty(entries, dtype=torch.long)
        self.reserve_bound = torch.empty(entries, groups)
        self.reserve_count = torch.empty(n_chunks if band else 0, h_kv, dtype=torch.long)

    NAMES = ("s_dense", "sample", "ref", "z", "t", "gate", "m", "l", "o", "counts", "mass", "result", "per_head",
             "per_req", "masses", "z_lb", "hist", "habs", "certificate", "band_m", "band_l", "band_o", "band_counts",
             "band_mass", "band_pb", "band_mag", "reserve_slot", "reserve_pos", "reserve_bound", "reserve_count")

    def named(self) -> dict[str, torch.Tensor]:
        """The buffers by the names the compiled ops take them."""
        return {name: getattr(self, name) for name in self.NAMES}

    @property
    def totals(self):
        return self.per_head, self.per_req, self.masses

    def exact_part(self, plan: DecodePlan) -> ExactPart:
        z = self.z
        return ExactPart(self.s_dense, self.ref, z[..., 0], z[..., 0] + z[..., 1], (self.sample, plan.samples_per_request))


def _exact(ops, q32, k_cache, plan: DecodePlan, sigma: float, part: _Outputs, budget: float) -> ExactPart:
    ops.exact_part(q=q32, k_cache=k_cache, dense_slots=plan.dense_slots, dense_req=plan.dense_req,
                   sample_slots=plan.sample_slots, sample_req=plan.sample_req, sigma=float(sigma),
                   budget=float(budget), s_dense=part.s_dense, sample=part.sample, ref=part.ref, z=part.z, t=part.t)
    return part.exact_part(plan)


def compiled_exact_part(q32, k_cache, plan: DecodePlan, sigma: float, sample_size: int, ops,
                        budget: float = -1.0) -> tuple[ExactPart, torch.Tensor | None]:
    """``impl_torch.exact_part`` in one compiled call (the sample padded to ``sample_size`` rows, which
    the budget quantile does not see: padding is −inf), and with ``budget`` >= 0 the budget
    policy's T ``[B, H_q]`` (else None)."""
    batch, heads = q32.shape[:2]
    part = _Outputs(batch, heads, k_cache.shape[1], k_cache.shape[2], 0, len(plan.dense_slots), sample_size)
    ex = _exact(ops, q32, k_cache, plan, sigma, part, budget)
    return ex, (part.t if budget >= 0 else None)


