"""The ``triton`` decode implementation: Triton kernels, caller-owned buffers, no host sync.

Launches: ``exact_part`` (ref, Z_lb, the sample, and the budget policy's T) -> for the certified
policy ``certified_hist`` and ``certified_threshold`` -> ``attend`` (fused filter and sparse
split-K attention) -> for the a-posteriori certified rule the check against Z_att, the lowered
level and the band pass (``a_posteriori_band``) -> with a dense fallback fraction below 1 the
fallback flags and the fallback pass (the flagged requests' splits recomputed densely) ->
``merge`` (splits into the output).
Statistics are computed only when asked for. Nothing reads a device value on the host and every
buffer comes from a ``GpuWorkspace`` allocated once, so the step can be captured in a CUDA graph
for a fixed batch size and page-table width.

There are no candidate lists: each split gates its pages' tokens and attends the survivors in the
same pass, so no list has a capacity to overflow. The certificate is the histogram's own sum
plus a bound on its fp64 rounding (``threshold.certified_choice``), with no recount pass.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from ..config import LouverConfig
from ..index.store import PageIndexStore
from . import threshold as th
from .contract import (
    BUDGET_SAFETY, EDGES, FP64_SUM_DOWN, HIST_ROUNDING, VALUE_GATE, DecodeImplementation, DecodeResult, HeadShapes,
    RequestLayout, StepStats,
)

from louver_kernels.triton import grid_decode as kern  # noqa: E402 (after the project's own imports)
from louver_kernels.triton.launch import TritonLaunch  # noqa: E402


@dataclass
class BandBuffers:
    """The a-posteriori certified rule's buffers (``certified_rule='a_posteriori'``), beside a
    ``GpuWorkspace`` of the same capacity."""

    first: torch.Tensor  # [Bmax, H_q] fp32: T0, the first pass's level (from the estimate)
    second: torch.Tensor  # [Bmax, H_q] fp32: T1 from Z_att, then the band pass's level (+inf: not lowered)
    second_cert: torch.Tensor  # [Bmax, H_q] fp64: the certificate at T1
    lowered: torch.Tensor  # [Bmax, H_q] bool: heads whose first level did not fit eps·Z_att
    z_att: torch.Tensor  # [Bmax, H_q] fp64: the Z_att the certificate was checked against
    z_union: torch.Tensor  # [Bmax, H_kv, S, BG] fp64: the first pass's union mass (Z_att) per split
    m: torch.Tensor  # [Bmax, H_kv, S, BG] fp32: the band pass's split state, as GpuWorkspace's
    l: torch.Tensor
    o: torch.Tensor  # [Bmax, H_kv, S, BG, D_v] fp32
    counts: torch.Tensor  # [Bmax, H_kv, S, 5, BG] int32
    mass: torch.Tensor  # [Bmax, H_kv, S, 2, BG] fp32
    z_own: torch.Tensor  # [Bmax, H_kv, S, BG] fp64

    @classmethod
    def like(cls, ws: "GpuWorkspace") -> "BandBuffers":
        return cls(first=torch.empty_like(ws.threshold), second=torch.empty_like(ws.threshold),
                   second_cert=torch.zeros_like(ws.certificate),
                   lowered=torch.zeros(ws.ref.shape, dtype=torch.bool, device=ws.ref.device),
                   z_att=torch.zeros_like(ws.certificate),
                   z_union=torch.zeros(ws.m.shape, dtype=torch.float64, device=ws.m.device),
                   m=torch.empty_like(ws.m), l=torch.empty_like(ws.l), o=torch.empty_like(ws.o),
                   counts=torch.empty_like(ws.counts), mass=torch.empty_like(ws.mass),
                   z_own=torch.empty_like(ws.z_own))

    def view(self, batch: int) -> "BandBuffers":
        return BandBuffers(**{k: v[:batch] for k, v in self.__dict__.items()})


@dataclass
class GpuWorkspace:
    """Address-stable buffers of the GPU step for up to ``max_batch`` requests whose page tables
    are ``max_pages`` wide. ``view(batch)`` returns leading slices (same storage)."""

    page_table: torch.Tensor  # [Bmax, W] int32: the plan's page table
    seq_lens: torch.Tensor  # [Bmax] int32: the plan's lengths
    ref: torch.Tensor  # [Bmax, H_q] fp32
    z_lb: torch.Tensor  # [Bmax, H_q] fp64
    sample: torch.Tensor  # [Bmax, H_q, M] fp32
    hist: torch.Tensor  # [Bmax, H_q, edges + 2] fp64
    habs: torch.Tensor  # [Bmax, H_q, edges + 2] fp64
    threshold: torch.Tensor  # [Bmax, H_q] fp32
    certificate: torch.Tensor  # [Bmax, H_q] fp64
    z_att: torch.Tensor  # [Bmax, H_q] fp64
    m: torch.Tensor  # [Bmax, H_kv, S, BG] fp32
    l: torch.Tensor  # [Bmax, H_kv, S, BG] fp32
    o: torch.Tensor  # [Bmax, H_kv, S, BG, D_v] fp32
    counts: torch.Tensor  # [Bmax, H_kv, S, 5, BG] int32
    mass: torch.Tensor  # [Bmax, H_kv, S, 2, BG] fp32
    z_own: torch.Tensor  # [Bmax, H_kv, S, BG] fp64: lower bound of each split's attended mass per head
    union: torch.Tensor  # [Bmax] int64: union candidates (the fallback decision)
    fallback: torch.Tensor  # [Bmax] bool: requests over the dense-fallback fraction
    lowered: torch.Tensor  # [Bmax, H_q] bool: the one-pass rule's heads whose check failed (StepStats.lowered)
    max_pages: int
    band: BandBuffers | None = None  # the a-posteriori rule's buffers, where the config asks for it

    @classmethod
    def allocate(cls, max_batch: int, max_pages: int, shapes: HeadShapes, config: LouverConfig,
                 launch: TritonLaunch, device) -> "GpuWorkspace":
        heads_q, heads_kv = shapes.num_q_heads, shapes.num_kv_heads
        bg = kern.block_g(heads_q // heads_kv, launch)
        splits = kern.num_splits(max_pages, launch)
        f32 = dict(dtype=torch.float32, device=device)
        f64 = dict(dtype=torch.float64, device=device)
        state = (max_batch, heads_kv, splits, bg)
        ws = cls(
            page_table=torch.zeros(max_batch, max_pages, dtype=torch.int32, device=device),
            seq_lens=torch.ones(max_batch, dtype=torch.int32, device=device),
            ref=torch.empty(max_batch, heads_q, **f32), z_lb=torch.empty(max_batch, heads_q, **f64),
            sample=torch.empty(max_batch, heads_q, config.sample_size, **f32),
            hist=torch.zeros(max_batch, heads_q, EDGES.hist_width, **f64),
            habs=torch.zeros(max_batch, heads_q, EDGES.hist_width, **f64),
            threshold=torch.empty(max_batch, heads_q, **f32), certificate=torch.zeros(max_batch, heads_q, **f64),
            z_att=torch.empty(max_batch, heads_q, **f64),
            m=torch.empty(state, **f32), l=torch.empty(state, **f32),
            o=torch.empty(*state, shapes.head_dim_v, **f32),
            counts=torch.empty(max_batch, heads_kv, splits, 5, bg, dtype=torch.int32, device=device),
            mass=torch.empty(max_batch, heads_kv, splits, 2, bg, **f32),
            z_own=torch.zeros(state, **f64),
            union=torch.zeros(max_batch, dtype=torch.int64, device=device),
            fallback=torch.zeros(max_batch, dtype=torch.bool, device=device),
            lowered=torch.zeros(max_batch, heads_q, dtype=torch.bool, device=device),
            max_pages=max_pages,
        )
        if config.threshold.band_pass:
            ws.band = BandBuffers.like(ws)
        return ws

    def view(self, batch: int) -> "GpuWorkspace":
        if batch > self.ref.shape[0]:
            raise ValueError(f"batch {batch} exceeds the workspace's {self.ref.shape[0]} requests")
        fields = {k: v[:batch] for k, v in self.__dict__.items() if isinstance(v, torch.Tensor)}
        return GpuWorkspace(**fields, max_pages=self.max_pages,
                            band=self.band.view(batch) if self.band is not None else None)

    @property
    def max_batch(self) -> int:
        return self.ref.shape[0]

    def fits(self, shapes: HeadShapes, config: LouverConfig) -> bool:
        return (self.ref.shape[1] == shapes.num_q_heads and self.m.shape[1] == shapes.num_kv_heads
                and self.o.shape[-1] == shapes.head_dim_v and self.sample.shape[-1] == config.sample_size
                and (self.band is not None) == config.threshold.band_pass)


@dataclass
class TritonPlan:
    """A planned batch: ``batch`` requests whose page table and lengths were copied into the
    workspace (its ``view(batch)``), ``pages`` columns of the table in use."""

    batch: int
    pages: int
    workspace: GpuWorkspace

    @property
    def page_table(self) -> torch.Tensor:
        return self.workspace.page_table

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.workspace.seq_lens


class TritonImplementation(DecodeImplementation):
    """What the Triton implementations share: launch parameters, a workspace of
    ``workspace_class`` (allocated once when ``shapes`` and both capacities are given, else at
    the first run), ``plan`` by device copies into it, availability on CUDA or under the
    interpreter. Graph-safe: ``plan`` copies with device ops and ``run`` neither allocates nor
    reads the device on the host."""

    returns_attended = True
    int8_token_bounds = True
    workspace_class: type = None  # GpuWorkspace or a class with its allocate / view / fits / max_*

    def __init__(self, config, device, launch, shapes, capacity) -> None:
        super().__init__(config, device, launch, shapes, capacity)
        self.launch = launch if isinstance(launch, TritonLaunch) else TritonLaunch.from_dict(launch or {})
        self.workspace = None
        if shapes is not None and capacity.max_batch is not None and capacity.max_pages is not None:
            self.workspace = self.workspace_class.allocate(capacity.max_batch, capacity.max_pages, shapes, config,
                                                           self.launch, device)

    @classmethod
    def unavailable(cls, device: torch.device) -> str | None:
        if device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
            return None
        return "it needs a CUDA device (or CPU tensors under TRITON_INTERPRET=1, for tests)"

    @classmethod
    def check_config(cls, config: LouverConfig, device: torch.device) -> None:
        if not config.grid_codes:
            cls.reject("family", config.family, "the Triton kernels read grid codes")

    def plan(self, page_table: torch.Tensor, seq_lens: torch.Tensor) -> TritonPlan:
        """Copy the batch into the workspace (device ops only: the copies are captured and replayed
        with a decode graph). Shapes are checked, values are not (that would read the device)."""
        if page_table.dim() != 2 or seq_lens.dim() != 1 or page_table.shape[0] != seq_lens.shape[0]:
            raise ValueError(f"page_table must be [B, W] and seq_lens [B]; got {tuple(page_table.shape)}, "
                             f"{tuple(seq_lens.shape)}")
        batch, pages = page_table.shape
        self.capacity.check(batch, pages)
        ws = self.workspace
        if ws is None or ws.max_batch < batch or ws.max_pages < pages:
            if self.shapes is None:  # allocated at the first run, which knows the shapes
                return TritonPlan(batch, pages, _Pending(page_table, seq_lens))
            ws = self.workspace = self.workspace_class.allocate(batch, pages, self.shapes, self.config, self.launch,
                                                                self.device)
        view = ws.view(batch)
        view.page_table[:, :pages].copy_(page_table)
        view.seq_lens.copy_(seq_lens)
        return TritonPlan(batch, pages, view)

    def _allocate_for(self, plan: "TritonPlan", q, k_cache, v_cache) -> "TritonPlan":
        pending = plan.workspace
        self.shapes = HeadShapes(q.shape[1], k_cache.shape[1], k_cache.shape[2], v_cache.shape[2])
        if self.workspace is not None and not self.workspace.fits(self.shapes, self.config):
            self.workspace = None
        return self.plan(pending.page_table, pending.seq_lens)


class TritonDecode(TritonImplementation):
    """The Triton kernels (grid family, token-layout codes, head dims 64 and 128) on CUDA devices,
    or on CPU tensors under ``TRITON_INTERPRET=1`` (tests), filter and attention fused per split."""

    name = "triton"
    workspace_class = GpuWorkspace
    one_pass_certified = False  # whether it runs the one-pass certified rule (certified_passes=1)

    @classmethod
    def check_config(cls, config: LouverConfig, device: torch.device) -> None:
        super().check_config(config, device)
        if config.threshold.one_pass and not cls.one_pass_certified:
            cls.reject("certified_passes", 1, "its kernels choose the certified T by the histogram pass")
        if config.threshold.one_pass_a_posteriori:
            cls.reject("certified_rule", "a_posteriori", "with certified_passes=1: its one-pass check divides by "
                       "Z_lb on the device (use certified_passes=2 for the a-posteriori rule)")
        if config.adaptive_share:
            cls.reject("estimate_share_max", config.estimate_share_max, "its steps replay CUDA graphs with the "
                       "config's one estimate share (leave estimate_share_max at 0)")

    def run(self, plan: TritonPlan, *, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            store: PageIndexStore, sigma: float, out: torch.Tensor | None = None, stats: bool = False,
            attended: bool = False) -> DecodeResult:
        if isinstance(plan.workspace, _Pending):
            plan = self._allocate_for(plan, q, k_cache, v_cache)
        check_run(q, k_cache, v_cache, plan, store, self.config)
        batch, heads, _ = q.shape
        if out is None:
            out = torch.empty((batch, heads, v_cache.shape[2]), dtype=q.dtype, device=q.device)
        q = q if q.stride(-1) == 1 else q.contiguous()
        keep = None
        if attended:
            keep = torch.zeros(batch, heads, plan.workspace.page_table.shape[1] * self.config.page_size,
                               dtype=torch.int8, device=q.device)
        self.launches(q, k_cache, v_cache, plan.workspace, store, sigma, out, keep)
        counted = step_stats(plan.workspace, heads, self.config) if stats or attended else None
        masks = attended_masks(keep, plan.workspace.seq_lens) if attended else None
        return DecodeResult(out, counted, masks)

    def launches(self, q, k_cache, v_cache, ws: GpuWorkspace, store, sigma: float, out, keep) -> None:
        """The kernels of one step on the workspace view ``ws`` of a planned batch."""
        for _, stage in self.stages(q, k_cache, v_cache, ws, store, sigma, out, keep):
            stage()

    def stages(self, q, k_cache, v_cache, ws: GpuWorkspace, store, sigma: float, out, keep) -> list:
        """The step as named stages ``[(name, fn)]``, run in order; each reads what earlier ones
        wrote and overwrites its own outputs, so the benchmark can time each alone."""
        return fused_stages(q, k_cache, v_cache, ws, store, sigma, self.config, self.launch, out, keep)


@dataclass
class _Pending:
    """A plan's page table and lengths until the first run knows the shapes of its workspace."""

    page_table: torch.Tensor
    seq_lens: torch.Tensor


def fused_stages(q, k_cache, v_cache, ws: GpuWorkspace, store, sigma: float, config: LouverConfig,
                 launch: TritonLaunch, out, keep) -> list:
    """The launches of one step (module docstring) on the workspace view of a planned batch, as
    named stages."""
    h_kv = k_cache.shape[1]
    z_union = ws.band.z_union if ws.band is not None else None
    stages = threshold_stages(q, k_cache, ws, store, sigma, config, launch)
    stages.append(("attend", lambda: kern.attend(
        q, k_cache, v_cache, ws.page_table, ws.seq_lens, store.tensors, ws.threshold, ws.ref, ws.m, ws.l, ws.o,
        ws.counts, ws.mass, ws.z_own, sigma, z_union=z_union, **_attend_options(config, launch, keep))))
    if ws.band is not None:
        stages.append(("band", lambda: a_posteriori_band(q, k_cache, v_cache, ws, store, sigma, config, launch, keep)))
    stages.append(("fallback_flags", lambda: fallback_flags(ws, RequestLayout.of(config), h_kv,
                                                            config.dense_fallback_fraction)))
    # a request can exceed the fraction only below 1; the dense policy's attend pass was dense already
    if config.dense_fallback_fraction < 1.0 and not config.threshold.dense:
        stages.append(("dense_fallback", lambda: dense_fallback_pass(q, k_cache, v_cache, ws, store, sigma, config,
                                                                     launch, keep)))
    stages.append(("merge", lambda: kern.merge(ws.m, ws.l, ws.o, ws.z_own, out, ws.z_att, sigma, FP64_SUM_DOWN,
                                               launch)))
    return stages


def _attend_options(config: LouverConfig, launch: TritonLaunch, keep) -> dict:
    """The keyword arguments of ``grid_decode.attend`` that come from the config and launch."""
    layout = RequestLayout.of(config).constexprs()
    return dict(layout=layout, min_sparse=config.min_sparse_tokens, bits=config.grid_bits,
                gate=config.threshold.gates_values, gate_rel=VALUE_GATE.rel, launch=launch, attended=keep)


def dense_fallback_pass(q, k_cache, v_cache, ws: GpuWorkspace, store, sigma: float, config: LouverConfig,
                        launch: TritonLaunch, keep) -> None:
    """The split states of the requests flagged in ws.fallback recomputed densely (every other
    program returns at once)."""
    kern.attend(q, k_cache, v_cache, ws.page_table, ws.seq_lens, store.tensors, ws.threshold, ws.ref, ws.m, ws.l,
                ws.o, ws.counts, ws.mass, ws.z_own, sigma, fallback=ws.fallback, **_attend_options(config, launch, keep))


def threshold_pass(q, k_cache, ws: GpuWorkspace, store, sigma: float, config: LouverConfig,
                   launch: TritonLaunch) -> None:
    """ws.ref, ws.z_lb, the sample and ws.threshold (T per head under the config's policy; for
    the certified policy also ws.certificate) of a planned batch."""
    for _, stage in threshold_stages(q, k_cache, ws, store, sigma, config, launch):
        stage()


def threshold_stages(q, k_cache, ws: GpuWorkspace, store, sigma: float, config: LouverConfig,
                     launch: TritonLaunch) -> list:
    """``threshold_pass``'s launches as named stages."""
    h_kv = k_cache.shape[1]
    layout = RequestLayout.of(config).constexprs()
    lens, table, min_sparse = ws.seq_lens, ws.page_table, config.min_sparse_tokens
    policy = config.threshold
    certified = policy.certified

    def exact() -> None:
        kern.exact_part(q, k_cache, table, lens, ws.ref, ws.z_lb, ws.sample, sigma, layout, min_sparse, FP64_SUM_DOWN,
                        launch=launch, budget_threshold=ws.threshold if policy.budget_rule else None,
                        budget=policy.budget, hist=ws.hist if certified else None,
                        habs=ws.habs if certified else None)
        if policy.static_threshold is not None:
            ws.threshold.fill_(policy.static_threshold)

    def threshold() -> None:
        # the a-posteriori rule's first level fits the estimate of Z; the histogram rule's, Z_lb
        z = _estimated_z(ws, sigma, config) if ws.band is not None else ws.z_lb
        kern.certified_threshold(ws.hist, ws.habs, ws.ref, z, ws.threshold, ws.certificate, sigma,
                                 policy.kernel_eps_budget(BUDGET_SAFETY), HIST_ROUNDING, h_kv, EDGES, launch)

    stages = [("exact_part", exact)]
    if certified:  # the histogram accumulates into what exact_part zeroed
        stages.append(("certified_hist", lambda: kern.certified_hist(
            q, table, lens, store.tensors, ws.ref, ws.hist, ws.habs, sigma, layout, min_sparse, config.grid_bits, EDGES,
            launch)))
        stages.append(("certified_threshold", threshold))
    return stages


def _estimated_z(ws: GpuWorkspace, sigma: float, config: LouverConfig) -> torch.Tensor:
    """``threshold.estimated_z`` from the exact part's outputs, by device ops: the sample's mass
    (its scores are in ws.sample, −inf padded) and the dense part's (Z_lb minus it)."""
    finite = ~torch.isneginf(ws.sample)
    x = (sigma * (ws.sample.double() - ws.ref.double()[..., None])).clamp(max=700.0)
    z_sample = torch.where(finite, torch.exp(x), 0.0).nan_to_num(nan=0.0).sum(-1)
    z_dense = (ws.z_lb - z_sample).clamp(min=0.0)
    num_indexed = RequestLayout.of(config).indexed_tokens(ws.seq_lens)
    return th.estimated_z(z_dense, z_sample, num_indexed, finite[:, 0].sum(-1), config.estimate_share)


def a_posteriori_band(q, k_cache, v_cache, ws: GpuWorkspace, store, sigma: float, config: LouverConfig,
                      launch: TritonLaunch, keep, skip=None) -> None:
    """The check and the band of the a-posteriori rule (``threshold.a_posteriori_second``) after
    the first pass at T0 = ws.threshold: Z_att = max(Z_lb, the first pass's union mass); a head
    whose certificate does not fit eps·Z_att takes T1, the largest edge that does, and the band
    pass (always launched; programs of groups with no lowered head return at once) attends its
    tokens between T1 and T0. The band's split state is merged into the first pass's by
    log-sum-exp, its counters added. ``skip``: optional ``[B]`` bool, requests not lowered (the
    dense fallback recomputes them). Device ops only: graph-safe."""
    band = ws.band
    batch, heads = ws.ref.shape
    h_kv = k_cache.shape[1]
    groups = heads // h_kv
    eps_budget = config.eps * BUDGET_SAFETY
    # the splits' lower bounds summed in fp64, lowered by that sum's rounding as Z_lb is
    union_mass = band.z_union[..., :groups].sum(2).reshape(batch, heads) * FP64_SUM_DOWN
    z_att = torch.fmax(ws.z_lb, union_mass, out=band.z_att)
    band.first.copy_(ws.threshold)
    kern.certified_threshold(ws.hist, ws.habs, ws.ref, z_att, band.second, band.second_cert, sigma, eps_budget,
                             HIST_ROUNDING, h_kv, EDGES, launch)
    lowered = ~(ws.certificate <= eps_budget * z_att) & (band.first > -math.inf)
    if skip is not None:
        lowered &= ~skip[:, None]
    band.lowered.copy_(lowered)
    ws.threshold.copy_(torch.where(lowered, band.second, band.first))
    ws.certificate.copy_(torch.where(lowered, band.second_cert, ws.certificate))
    band.second.copy_(torch.where(lowered, band.second, math.inf))
    # z_union: the first pass's launch options, so that the band runs its very binary (the band's
    # own union mass is not read: band.z_union was summed above)
    kern.attend(q, k_cache, v_cache, ws.page_table, ws.seq_lens, store.tensors, band.second, ws.ref, band.m,
                band.l, band.o, band.counts, band.mass, band.z_own, sigma, band_ceiling=band.first,
                z_union=band.z_union, **_attend_options(config, launch, keep))
    _combine_band(ws, lowered.view(batch, h_kv, groups))


def _combine_band(ws: GpuWorkspace, lowered) -> None:
    """The band's split states merged into ws's (log-sum-exp per split and head), its counters
    added; skipped pages per head are the band's where the head was lowered (``lowered``
    ``[B, H_kv, G]``)."""
    band = ws.band
    top = torch.maximum(ws.m, band.m)
    top_safe = torch.where(top == -math.inf, 0.0, top)
    first, second = torch.exp(ws.m - top_safe), torch.exp(band.m - top_safe)
    ws.l.copy_(ws.l * first + band.l * second)
    ws.o.copy_(ws.o * first[..., None] + band.o * second[..., None])
    ws.m.copy_(top)
    ws.z_own.add_(band.z_own)
    lowered_rows = torch.zeros(ws.counts[:, :, :1, 1].shape, dtype=torch.bool, device=lowered.device)
    lowered_rows[..., : lowered.shape[-1]] = lowered[:, :, None, :]
    skipped = torch.where(lowered_rows, band.counts[:, :, :, 1], ws.counts[:, :, :, 1])
    ws.counts.add_(band.counts)
    ws.counts[:, :, :, 1].copy_(skipped)


def fallback_flags(ws: GpuWorkspace, layout: RequestLayout, h_kv: int, fraction: float) -> None:
    """ws.union = union candidates per request, ws.fallback = those over ``fraction`` of the
    indexed keys (the torch path's comparison), by device ops into the workspace."""
    torch.sum(ws.counts[:, :, :, 2, 0], dim=(1, 2), out=ws.union)
    total = (layout.indexed_tokens(ws.seq_lens) * h_kv).clamp(min=1)
    torch.gt(ws.union, fraction * total, out=ws.fallback)


def step_stats(ws: GpuWorkspace, heads: int, config: LouverConfig) -> StepStats:
    batch, h_kv = ws.counts.shape[:2]
    groups = heads // h_kv
    per_head = lambda x: x[..., :groups].sum(2).reshape(batch, heads)
    z_final = torch.maximum(ws.z_lb, ws.z_att)
    if ws.band is not None:
        # a head attends its own candidates, but its certificate was checked against the mass of
        # the group's whole union at T0: also a lower bound of Z, and the one the bound is reported
        # against (the head's own attended mass alone can be smaller: the report exceeded eps)
        z_final = torch.fmax(z_final, ws.band.z_att)
    if config.threshold.dense:
        dropped = torch.zeros_like(z_final)
    elif config.threshold.certified:
        dropped = ws.certificate
    else:
        dropped = per_head(ws.mass[:, :, :, 0]).double() + per_head(ws.mass[:, :, :, 1]).double()
    counts = ws.counts.long()
    num_indexed = RequestLayout.of(config).indexed_tokens(ws.seq_lens)
    fallback = ws.fallback.clone()
    sparse_values = counts[:, :, :, 3, 0].sum((1, 2))
    return StepStats(
        threshold=ws.threshold.clone(),
        candidates=torch.where(fallback[:, None], num_indexed[:, None], per_head(counts[:, :, :, 0])),
        pages_skipped=per_head(counts[:, :, :, 1]),
        mass_bound=torch.where(fallback[:, None], 0.0, dropped / z_final),
        num_indexed=num_indexed, num_pages=num_indexed // config.page_size, dense_fallback=fallback,
        union_candidates=counts[:, :, :, 2, 0].sum((1, 2)),
        values_read=torch.where(fallback, num_indexed * h_kv, sparse_values),
        pages_read=counts[:, :, :, 4, 0].sum((1, 2)),
        lowered=(ws.band.lowered if ws.band is not None else ws.lowered).clone(),
    )


def attended_masks(keep: torch.Tensor, seq_lens: torch.Tensor) -> list[torch.Tensor]:
    """Per request, bool ``[H_q, L]`` from the attended buffer (reads the device: audits only)."""
    return [keep[b, :, :n].bool().cpu() for b, n in enumerate(seq_lens.tolist())]


def check_run(q, k_cache, v_cache, plan: TritonPlan, store, config: LouverConfig) -> None:
    if not store.config.grid_codes:
        raise ValueError("the 'triton' decode implementation reads grid-family stores")
    if store.code_layout != "token":
        raise ValueError("the GPU decode kernels read token-layout codes; make the store with code_layout='token'")
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.dim() != 3:
        raise ValueError("q must be [B, H_q, D] and k/v caches [slots, H_kv, D]")
    if q.shape[0] != plan.batch:
        raise ValueError(f"the plan is for {plan.batch} requests, q has {q.shape[0]}")
    if k_cache.shape[1:] != (store.num_kv_heads, store.head_dim) or q.shape[2] != store.head_dim:
        raise ValueError("q / k_cache do not match the index (H_kv, D)")
    if q.shape[1] % store.num_kv_heads:
        raise ValueError(f"H_q ({q.shape[1]}) must be a multiple of H_kv ({store.num_kv_heads})")
    if store.head_dim not in (64, 128) or v_cache.shape[2] not in (64, 128):
        raise ValueError("the GPU decode kernels support head dims 64 and 128")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k/v caches need a contiguous last dim")
    if any(getattr(config, f) != getattr(store.config, f) for f in ("page_size", "grid_bits")):
        raise ValueError("config index layout differs from the store's; rebuild the index")
