"""The ``triton_tiled`` decode implementation: a filter over page tiles that fills the GPU and
writes one survivor list per (request, KV head), then split-K attention over those lists with
the GQA group folded onto each row (``louver_kernels.triton.tiled_decode``).

Launches: ``exact_part`` (ref, Z_lb, the sample; the budget policy's T) -> ``tile_filter``
(every (request, KV head, tile) program compacts its survivors; certified: it also adds the mass
below each edge of a window of histogram edges and gives each survivor its level per head) ->
with ordered lists a prefix sum and ``compact_lists`` -> the dense-fallback flags where the
fraction is below 1 -> certified: ``window_threshold`` (T per head, the certificate, requests
whose level lies below the window flagged) -> ``tiled_attend`` -> certified: ``tiled_attend``
again for the flagged requests, densely -> ``merge``. The certified step reads the codes once.

Policies: dense (attention only), fixed, budget, and certified with the histogram rule
(``certified_passes=2``, ``certified_rule="histogram"``: the same T, found in one pass over the
codes, within the window; design notes, "Certified in one code pass"). The one-pass provisional
rule and the a-posteriori rule are refused by name. Nothing reads the device on the host and
every buffer is allocated once (``TiledWorkspace``), so a step can be captured in a CUDA graph
for a fixed batch size and page-table width.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..config import LouverConfig
from ..index.store import PageIndexStore
from .contract import (
    BUDGET_SAFETY, EDGES, FP64_SUM_DOWN, HIST_ROUNDING, VALUE_GATE, DecodeResult, HeadShapes, RequestLayout,
    StepStats,
)
from .impl_triton import TritonImplementation, TritonPlan, _Pending, attended_masks, check_run

from louver_kernels.triton import grid_decode as kern  # noqa: E402 (after the project's own imports)
from louver_kernels.triton import tiled_decode as tiled  # noqa: E402
from louver_kernels.triton.launch import TritonLaunch  # noqa: E402


@dataclass
class TiledWorkspace:
    """Address-stable buffers of a ``triton_tiled`` step for up to ``max_batch`` requests whose
    page tables are ``max_pages`` wide (S splits, NT tiles, C = NT·TP·P list rows, K window
    edges, GP the padded GQA group). ``view(batch)`` returns leading slices (same storage)."""

    page_table: torch.Tensor  # [Bmax, W] int32
    seq_lens: torch.Tensor  # [Bmax] int32
    ref: torch.Tensor  # [Bmax, H_q] fp32
    z_lb: torch.Tensor  # [Bmax, H_q] fp64
    sample: torch.Tensor  # [Bmax, H_q, M] fp32
    threshold: torch.Tensor  # [Bmax, H_q] fp32
    certificate: torch.Tensor  # [Bmax, H_q] fp64
    z_att: torch.Tensor  # [Bmax, H_q] fp64: lower bound of the attended mass (merge)
    m: torch.Tensor  # [Bmax, H_kv, S, BG] fp32
    l: torch.Tensor  # [Bmax, H_kv, S, BG] fp32
    o: torch.Tensor  # [Bmax, H_kv, S, BG, D_v] fp32
    z_own: torch.Tensor  # [Bmax, H_kv, S, BG] fp64
    counts: torch.Tensor  # [Bmax, H_kv, S, 3, BG] int32: indexed rows attended per head; V, K rows read
    gated: torch.Tensor  # [Bmax, H_kv, S, BG] fp32: value-gated mass (upper bound)
    slot: torch.Tensor  # [Bmax, H_kv, C] int32: the lists
    level: torch.Tensor  # [Bmax, H_kv, C, GP] uint8 (certified; else [Bmax, H_kv, 0, GP])
    total: torch.Tensor  # [Bmax, H_kv] int32: rows per list
    tile_slot: torch.Tensor  # [Bmax, H_kv, C] int32: the tiles' own regions (ordered lists)
    tile_level: torch.Tensor  # [Bmax, H_kv, C, GP] uint8
    tile_count: torch.Tensor  # [Bmax, H_kv, NT] int32
    offsets: torch.Tensor  # [Bmax, H_kv, NT] int32: inclusive prefix sums of tile_count
    tile_pages: torch.Tensor  # [Bmax, H_kv, NT, GP + 1] int32: pages skipped per head, pages read
    tile_dropped: torch.Tensor  # [Bmax, H_kv, NT, GP] fp64
    window: torch.Tensor  # [Bmax, H_kv, NT, GP, K] fp64 (certified; else K = 0)
    base: torch.Tensor  # [Bmax, H_kv, GP] int32: the window's lowest edge
    kstar: torch.Tensor  # [Bmax, H_kv, GP] int32: the chosen window edge
    flags: torch.Tensor  # [Bmax] int32: 1 dense before the attention, 2 dense after it (kernel docstring)
    union: torch.Tensor  # [Bmax] int64: union candidates (the keys the step reads; the fallback decision)
    max_pages: int
    pos: torch.Tensor | None = None  # [Bmax, H_kv, C] int32: token positions (audits)
    tile_pos: torch.Tensor | None = None

    @classmethod
    def allocate(cls, max_batch: int, max_pages: int, shapes: HeadShapes, config: LouverConfig,
                 launch: TritonLaunch, device) -> "TiledWorkspace":
        heads_q, heads_kv = shapes.num_q_heads, shapes.num_kv_heads
        groups = heads_q // heads_kv
        bg = kern.block_g(groups, launch)
        gp, tp = tiled.tile_shape(groups, config.page_size, launch)
        n_tiles = max(1, tiled.num_tiles(max_pages, groups, config.page_size, launch))
        cap = n_tiles * tp * config.page_size
        splits = launch.list_splits
        certified = config.threshold.certified
        k = launch.window_edges if certified else 0
        rows = cap if certified else 0
        f32 = dict(dtype=torch.float32, device=device)
        f64 = dict(dtype=torch.float64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        state = (max_batch, heads_kv, splits, bg)
        tiles = (max_batch, heads_kv, n_tiles)
        return cls(
            page_table=torch.zeros(max_batch, max_pages, **i32), seq_lens=torch.ones(max_batch, **i32),
            ref=torch.empty(max_batch, heads_q, **f32), z_lb=torch.empty(max_batch, heads_q, **f64),
            sample=torch.empty(max_batch, heads_q, config.sample_size, **f32),
            threshold=torch.empty(max_batch, heads_q, **f32), certificate=torch.zeros(max_batch, heads_q, **f64),
            z_att=torch.zeros(max_batch, heads_q, **f64),
            m=torch.empty(state, **f32), l=torch.empty(state, **f32), o=torch.empty(*state, shapes.head_dim_v, **f32),
            z_own=torch.zeros(state, **f64), counts=torch.zeros(max_batch, heads_kv, splits, 3, bg, **i32),
            gated=torch.zeros(state, **f32),
            slot=torch.zeros(max_batch, heads_kv, cap, **i32),
            level=torch.zeros(max_batch, heads_kv, rows, gp, dtype=torch.uint8, device=device),
            total=torch.zeros(max_batch, heads_kv, **i32),
            tile_slot=torch.zeros(max_batch, heads_kv, 0 if launch.tile_atomic else cap, **i32),
            tile_level=torch.zeros(max_batch, heads_kv, 0 if launch.tile_atomic else rows, gp, dtype=torch.uint8,
                                   device=device),
            tile_count=torch.zeros(tiles, **i32), offsets=torch.zeros(tiles, **i32),
            tile_pages=torch.zeros(*tiles, gp + 1, **i32), tile_dropped=torch.zeros(*tiles, gp, **f64),
            window=torch.zeros(*tiles, gp, k, **f64), base=torch.zeros(max_batch, heads_kv, gp, **i32),
            kstar=torch.zeros(max_batch, heads_kv, gp, **i32), flags=torch.zeros(max_batch, **i32),
            union=torch.zeros(max_batch, dtype=torch.int64, device=device),
            max_pages=max_pages)

    def with_positions(self) -> "TiledWorkspace":
        """Allocate the audit lists of token positions (``attended=True``) once."""
        if self.pos is None:
            self.pos = torch.zeros_like(self.slot)
            self.tile_pos = torch.zeros_like(self.tile_slot)
        return self

    def view(self, batch: int) -> "TiledWorkspace":
        if batch > self.max_batch:
            raise ValueError(f"batch {batch} exceeds the workspace's {self.max_batch} requests")
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        cut = {k: (v[:batch] if isinstance(v, torch.Tensor) else v) for k, v in values.items()}
        return TiledWorkspace(**cut)

    @property
    def max_batch(self) -> int:
        return self.ref.shape[0]

    def fits(self, shapes: HeadShapes, config: LouverConfig) -> bool:
        return (self.ref.shape[1] == shapes.num_q_heads and self.m.shape[1] == shapes.num_kv_heads
                and self.o.shape[-1] == shapes.head_dim_v and self.sample.shape[-1] == config.sample_size
                and (self.window.shape[-1] > 0) == config.threshold.certified)

    def lists(self) -> dict:
        return dict(slot=self.slot, level=self.level, total=self.total.view(-1), pos=self.pos)

    def tile_lists(self) -> dict:
        if self.tile_slot.shape[2] == 0:  # atomic: the tiles write the lists themselves
            return self.lists()
        return dict(slot=self.tile_slot, level=self.tile_level, total=self.total.view(-1), pos=self.tile_pos)

    def tile_stats(self) -> dict:
        return dict(count=self.tile_count, pages=self.tile_pages, dropped=self.tile_dropped, window=self.window,
                    base=self.base)


class TritonTiledDecode(TritonImplementation):
    """The tiled Triton kernels (grid family, token-layout codes, head dims 64 and 128) on CUDA
    devices, or on CPU tensors under ``TRITON_INTERPRET=1``. Graph-safe like ``triton``."""

    name = "triton_tiled"
    workspace_class = TiledWorkspace

    @classmethod
    def check_config(cls, config: LouverConfig, device: torch.device) -> None:
        super().check_config(config, device)
        if config.threshold.one_pass:
            cls.reject("certified_passes", 1, "its certified step reads the codes once with the histogram rule "
                       "(certified_passes=2 names that rule)")
        if config.threshold.a_posteriori:
            cls.reject("certified_rule", "a_posteriori", "its certified step evaluates the histogram rule")

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
        ws = plan.workspace
        keep = None
        if attended:
            self.workspace.with_positions()
            ws = self.workspace.view(batch)
            keep = torch.zeros(batch, heads, ws.page_table.shape[1] * self.config.page_size, dtype=torch.int8,
                               device=q.device)
        for _, stage in self.stages(q, k_cache, v_cache, ws, store, sigma, out, keep):
            stage()
        counted = tiled_stats(ws, heads, self.config) if stats or attended else None
        masks = attended_masks(keep, ws.seq_lens) if attended else None
        return DecodeResult(out, counted, masks)


    def stages(self, q, k_cache, v_cache, ws: TiledWorkspace, store, sigma: float, out, keep) -> list:
        """The step as named stages ``[(name, fn)]`` (``tiled_stages``)."""
        return tiled_stages(q, k_cache, v_cache, ws, store, sigma, self.config, self.launch, out, keep)


def tiled_step(q, k_cache, v_cache, ws: TiledWorkspace, store, sigma: float, config: LouverConfig,
               launch: TritonLaunch, out, keep) -> None:
    """The launches of one step (module docstring) on a planned workspace view."""
    for _, launch_stage in tiled_stages(q, k_cache, v_cache, ws, store, sigma, config, launch, out, keep):
        launch_stage()


def tiled_stages(q, k_cache, v_cache, ws: TiledWorkspace, store, sigma: float, config: LouverConfig,
                 launch: TritonLaunch, out, keep) -> list:
    """The step as named stages ``[(name, fn)]``, run in order (the benchmark times each alone:
    each reads only what earlier stages wrote and overwrites its own outputs)."""
    policy = config.threshold
    layout = RequestLayout.of(config).constexprs()
    h_kv = k_cache.shape[1]
    groups = q.shape[1] // h_kv
    positions = keep is not None
    eps_budget = config.eps * BUDGET_SAFETY
    window = (eps_budget, HIST_ROUNDING) if policy.certified else None
    stages = [("exact_part", lambda: _exact_part(q, k_cache, ws, sigma, config, launch, layout))]
    if not policy.dense:
        stages.append(("filter", lambda: _filter(q, ws, store, sigma, config, launch, layout, window, positions)))
        if not launch.tile_atomic:
            stages.append(("compact", lambda: _compact(ws, config, groups, launch, positions, window is not None)))
    if not policy.certified:  # the union is the lists' length: decide before the attention
        stages.append(("fallback_flags", lambda: _fallback_flags(ws, config, h_kv, before=True)))
    if policy.certified:
        stages.append(("window_threshold", lambda: tiled.window_threshold(
            ws.window, ws.base, ws.seq_lens, ws.ref, ws.z_lb, ws.threshold, ws.certificate, ws.kstar, ws.flags, sigma,
            layout, config.min_sparse_tokens, eps_budget, HIST_ROUNDING, groups, EDGES, launch)))
    attend = lambda flagged_only=False: tiled.tiled_attend(  # noqa: E731
        q, k_cache, v_cache, ws.page_table, ws.seq_lens, ws.lists(), ws.threshold, ws.ref, ws.flags,
        ws.kstar if policy.certified else None, ws.m, ws.l, ws.o, ws.z_own, ws.counts, ws.gated, sigma, layout,
        config.min_sparse_tokens, policy.gates_values, VALUE_GATE.rel, kern._kv_dtype(k_cache), launch,
        attended=keep, all_dense=policy.dense, flagged_only=flagged_only)
    stages.append(("attend", attend))
    if policy.certified:  # the union is the rows the attention read at each head's level
        stages.append(("fallback_flags", lambda: _fallback_flags(ws, config, h_kv, before=False)))
        stages.append(("attend_flagged", lambda: attend(flagged_only=True)))
    stages.append(("merge", lambda: kern.merge(ws.m, ws.l, ws.o, ws.z_own, out, ws.z_att, sigma, FP64_SUM_DOWN,
                                               launch)))
    return stages


def _exact_part(q, k_cache, ws: TiledWorkspace, sigma, config: LouverConfig, launch, layout) -> None:
    policy = config.threshold
    kern.exact_part(q, k_cache, ws.page_table, ws.seq_lens, ws.ref, ws.z_lb, ws.sample, sigma, layout,
                    config.min_sparse_tokens, FP64_SUM_DOWN, launch=launch,
                    budget_threshold=ws.threshold if policy.budget_rule else None, budget=policy.budget)
    if policy.static_threshold is not None:
        ws.threshold.fill_(policy.static_threshold)
    ws.flags.zero_()
    if policy.dense:
        ws.total.zero_()


def _filter(q, ws: TiledWorkspace, store, sigma, config: LouverConfig, launch, layout, window, positions) -> None:
    if launch.tile_atomic:
        ws.total.zero_()
    tiled.tile_filter(q, ws.page_table, ws.seq_lens, store.tensors, ws.threshold, ws.ref, ws.z_lb, ws.tile_lists(),
                      ws.tile_stats(), sigma, layout, config.min_sparse_tokens, config.grid_bits, EDGES, launch,
                      window=window, positions=positions)


def _compact(ws: TiledWorkspace, config: LouverConfig, groups: int, launch, positions: bool, levels: bool) -> None:
    torch.cumsum(ws.tile_count, dim=2, out=ws.offsets)
    ws.total.copy_(ws.offsets[:, :, -1])
    tiled.compact_lists(ws.tile_lists(), ws.lists(), ws.tile_count, ws.offsets, config.page_size, groups, launch,
                        positions=positions, levels=levels)


def _fallback_flags(ws: TiledWorkspace, config: LouverConfig, h_kv: int, before: bool) -> None:
    """ws.union (device ops), and the requests whose union exceeds the dense-fallback fraction
    flagged for dense attention: 1 ``before`` the attention (the lists' length; the dense
    policy's union is every indexed row), else 2 after it (the keys it read)."""
    num_indexed = RequestLayout.of(config).indexed_tokens(ws.seq_lens)
    if config.threshold.dense:
        ws.union.copy_(num_indexed * h_kv)
    elif before:
        torch.sum(ws.total, dim=1, dtype=torch.int64, out=ws.union)
    else:
        torch.sum(ws.counts[:, :, :, 2, 0], dim=(1, 2), dtype=torch.int64, out=ws.union)
    if config.dense_fallback_fraction >= 1.0:
        return
    over = ws.union > config.dense_fallback_fraction * (num_indexed * h_kv).clamp(min=1)
    torch.maximum(ws.flags, over.to(torch.int32) * (1 if before else 2), out=ws.flags)


def tiled_stats(ws: TiledWorkspace, heads: int, config: LouverConfig) -> StepStats:
    batch, h_kv = ws.m.shape[:2]
    groups = heads // h_kv
    per_split = lambda x: x[..., :groups].sum(2).reshape(batch, heads)  # noqa: E731  [B, H_kv, S, BG]
    per_tile = lambda x: x[..., :groups].sum(2).reshape(batch, heads)  # noqa: E731  [B, H_kv, NT, GP]
    num_indexed = RequestLayout.of(config).indexed_tokens(ws.seq_lens)
    fallback = ws.flags != 0
    z_final = torch.maximum(ws.z_lb, ws.z_att)
    policy = config.threshold
    if policy.dense:
        dropped = torch.zeros_like(z_final)
    elif policy.certified:
        dropped = ws.certificate
    else:
        dropped = per_tile(ws.tile_dropped) + per_split(ws.gated).double()
    counts = ws.counts.long()
    return StepStats(
        threshold=ws.threshold.clone(),
        candidates=torch.where(fallback[:, None], num_indexed[:, None], per_split(counts[:, :, :, 0])),
        pages_skipped=torch.zeros_like(ws.threshold, dtype=torch.long) if policy.dense
        else per_tile(ws.tile_pages[..., :-1].long()),
        mass_bound=torch.where(fallback[:, None], 0.0, dropped / z_final),
        num_indexed=num_indexed, num_pages=num_indexed // config.page_size, dense_fallback=fallback,
        union_candidates=ws.union.clone(),
        values_read=torch.where(fallback, num_indexed * h_kv, counts[:, :, :, 1, 0].sum((1, 2))),
        pages_read=(num_indexed // config.page_size) * h_kv if policy.dense
        else ws.tile_pages[..., -1].long().sum((1, 2)),
        lowered=torch.zeros_like(ws.threshold, dtype=torch.bool),  # its rules have no check to fail
    )

