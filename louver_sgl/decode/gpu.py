"""The louver decode step on CUDA devices: Triton kernels, caller-owned buffers, no host sync.

Launches: ``exact_part`` (ref, Z_lb, the sample, and the budget policy's T) -> for the certified
policy ``certified_hist`` and ``certified_threshold`` -> ``attend`` (fused filter and sparse
split-K attention) -> ``merge`` (splits into the output). Statistics are computed only when asked
for. Nothing reads a device value on the host and every buffer comes from a ``GpuWorkspace``
allocated once, so the step can be captured in a CUDA graph for a fixed batch size and page-table
width.

There are no candidate lists: each split gates its pages' tokens and attends the survivors in the
same pass, so no list has a capacity to overflow and no dense fallback is needed for correctness
(``dense_fallback_fraction`` is a CPU-path setting). The certificate is the histogram's own sum
plus a bound on its fp64 rounding, so no recount pass is needed either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from louver_kernels.triton import grid_decode as kern
from louver_kernels.triton.launch import TritonLaunch

from ..config import LouverConfig
from ..index.store import PageIndexStore
from . import threshold as th
from .step import StepStats, gates_values

@dataclass
class GpuWorkspace:
    """Address-stable buffers of the GPU step for up to ``max_batch`` requests whose page tables
    are ``max_pages`` wide. ``view(batch)`` returns leading slices (same storage)."""

    ref: torch.Tensor  # [Bmax, H_q] fp32
    z_lb: torch.Tensor  # [Bmax, H_q] fp64
    sample: torch.Tensor  # [Bmax, H_q, M] fp32
    hist: torch.Tensor  # [Bmax, H_q, 259] fp64
    habs: torch.Tensor  # [Bmax, H_q, 259] fp64
    threshold: torch.Tensor  # [Bmax, H_q] fp32
    certificate: torch.Tensor  # [Bmax, H_q] fp64
    z_att: torch.Tensor  # [Bmax, H_q] fp64
    m: torch.Tensor  # [Bmax, H_kv, S, BG] fp32
    l: torch.Tensor  # [Bmax, H_kv, S, BG] fp32
    o: torch.Tensor  # [Bmax, H_kv, S, BG, D_v] fp32
    counts: torch.Tensor  # [Bmax, H_kv, S, 5, BG] int32
    mass: torch.Tensor  # [Bmax, H_kv, S, 2, BG] fp32
    max_pages: int

    @classmethod
    def allocate(cls, max_batch: int, max_pages: int, heads_q: int, heads_kv: int, head_dim_v: int,
                 config: LouverConfig, launch: TritonLaunch, device) -> "GpuWorkspace":
        if heads_q % heads_kv:
            raise ValueError(f"H_q ({heads_q}) must be a multiple of H_kv ({heads_kv})")
        bg = kern.block_g(heads_q // heads_kv, launch)
        splits = kern.num_splits(max_pages, launch)
        f32 = dict(dtype=torch.float32, device=device)
        f64 = dict(dtype=torch.float64, device=device)
        state = (max_batch, heads_kv, splits, bg)
        return cls(
            ref=torch.empty(max_batch, heads_q, **f32), z_lb=torch.empty(max_batch, heads_q, **f64),
            sample=torch.empty(max_batch, heads_q, config.sample_size, **f32),
            hist=torch.zeros(max_batch, heads_q, th.EDGE_COUNT + 2, **f64),
            habs=torch.zeros(max_batch, heads_q, th.EDGE_COUNT + 2, **f64),
            threshold=torch.empty(max_batch, heads_q, **f32), certificate=torch.zeros(max_batch, heads_q, **f64),
            z_att=torch.empty(max_batch, heads_q, **f64),
            m=torch.empty(state, **f32), l=torch.empty(state, **f32),
            o=torch.empty(*state, head_dim_v, **f32),
            counts=torch.empty(max_batch, heads_kv, splits, 5, bg, dtype=torch.int32, device=device),
            mass=torch.empty(max_batch, heads_kv, splits, 2, bg, **f32),
            max_pages=max_pages,
        )

    def view(self, batch: int) -> "GpuWorkspace":
        if batch > self.ref.shape[0]:
            raise ValueError(f"batch {batch} exceeds the workspace's {self.ref.shape[0]} requests")
        fields = {k: v[:batch] for k, v in self.__dict__.items() if isinstance(v, torch.Tensor)}
        return GpuWorkspace(**fields, max_pages=self.max_pages)


def louver_decode_gpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    store: PageIndexStore,
    sigma: float,
    config: LouverConfig | None = None,
    launch: TritonLaunch = TritonLaunch(),
    workspace: GpuWorkspace | None = None,
    out: torch.Tensor | None = None,
    attended: torch.Tensor | None = None,
    with_stats: bool = True,
) -> tuple[torch.Tensor, StepStats | None]:
    """One decode step on the GPU (grid family).

    Args:
        q: ``[B, H_q, D]`` fp16/bf16/fp32 queries. k_cache, v_cache: ``[num_slots, H_kv, D]`` /
            ``[num_slots, H_kv, D_v]`` paged KV buffers (fp16/bf16/fp32).
        page_table: ``[B, W]`` int32/int64 page ids; seq_lens: ``[B]`` int32/int64 (>= 1, <= W·P).
        store: the grid page index on the same device (every full indexed page built).
        sigma: softmax scale. config: defaults to ``store.config``. launch: kernel launch parameters.
        workspace: caller-owned buffers (allocated here when omitted: not graph-safe).
        out: caller-owned ``[B, H_q, D_v]`` output (last dim contiguous).
        attended: optional zeroed ``[B, H_q, W * P]`` int8 buffer that receives the attended mask
            per token position (audits and tests).
        with_stats: compute ``StepStats`` (a few extra device ops; serving asks only at log time).

    Returns ``(out, StepStats or None)``; statistics stay on the device and ``pages_read`` counts
    (page, KV head) pairs whose codes were read.
    """
    config = config or store.config
    _check(q, k_cache, v_cache, page_table, store, config)
    batch, heads, _ = q.shape
    h_kv, d_v = k_cache.shape[1], v_cache.shape[2]
    if workspace is None:
        workspace = GpuWorkspace.allocate(batch, page_table.shape[1], heads, h_kv, d_v, config, launch, q.device)
    if workspace.max_pages != page_table.shape[1]:
        raise ValueError(f"workspace is for page tables {workspace.max_pages} wide, got {page_table.shape[1]}")
    ws = workspace.view(batch)
    q = q if q.stride(-1) == 1 else q.contiguous()
    if out is None:
        out = torch.empty((batch, heads, d_v), dtype=q.dtype, device=q.device)
    layout = dict(page_size=config.page_size, sink_pages=config.sink_pages, recent_pages=config.recent_pages)
    certified = config.policy == "certified"
    kern.exact_part(q, k_cache, page_table, seq_lens, ws.ref, ws.z_lb, ws.sample, sigma, launch=launch,
                    budget_threshold=ws.threshold if config.policy == "budget" else None, budget=config.budget,
                    hist=ws.hist if certified else None, habs=ws.habs if certified else None, **layout)
    if config.policy in ("dense", "fixed"):
        ws.threshold.fill_(-math.inf if config.policy == "dense" else config.fixed_threshold)
    if certified:
        kern.certified_hist(q, page_table, seq_lens, store.tensors, ws.ref, ws.hist, ws.habs, sigma,
                            bits=config.grid_bits, launch=launch, **layout)
        kern.certified_threshold(ws.hist, ws.habs, ws.ref, ws.z_lb, ws.threshold, ws.certificate, sigma,
                                 config.eps * th.BUDGET_SAFETY, th.HIST_ROUNDING, h_kv, launch)
    kern.attend(q, k_cache, v_cache, page_table, seq_lens, store.tensors, ws.threshold, ws.ref,
                ws.m, ws.l, ws.o, ws.counts, ws.mass, sigma, bits=config.grid_bits, gate=gates_values(config),
                launch=launch, attended=attended, **layout)
    kern.merge(ws.m, ws.l, ws.o, ws.ref, out, ws.z_att, sigma, launch)
    return out, (_stats(ws, seq_lens, heads, config) if with_stats else None)


def indexed_tokens(seq_lens: torch.Tensor, config: LouverConfig) -> torch.Tensor:
    """Tokens read through the index per request ``[B]`` int64 (device-side ``split_pages``)."""
    full = seq_lens.long() // config.page_size
    sink = torch.clamp(full, max=config.sink_pages)
    recent = torch.minimum(full - sink, torch.full_like(full, config.recent_pages))
    return (full - sink - recent) * config.page_size


def _stats(ws: GpuWorkspace, seq_lens, heads: int, config: LouverConfig) -> StepStats:
    batch, h_kv = ws.counts.shape[:2]
    groups = heads // h_kv
    per_head = lambda x: x[..., :groups].sum(2).reshape(batch, heads)
    z_final = torch.maximum(ws.z_lb, ws.z_att)
    if config.policy == "dense":
        dropped = torch.zeros_like(z_final)
    elif config.policy == "certified":
        dropped = ws.certificate
    else:
        dropped = per_head(ws.mass[:, :, :, 0]).double() + per_head(ws.mass[:, :, :, 1]).double()
    counts = ws.counts.long()
    num_indexed = indexed_tokens(seq_lens, config)
    return StepStats(
        threshold=ws.threshold, candidates=per_head(counts[:, :, :, 0]),
        pages_skipped=per_head(counts[:, :, :, 1]), mass_bound=dropped / z_final,
        num_indexed=num_indexed, num_pages=num_indexed // config.page_size,
        dense_fallback=torch.zeros(batch, dtype=torch.bool, device=seq_lens.device),
        union_candidates=counts[:, :, :, 2, 0].sum((1, 2)), values_read=counts[:, :, :, 3, 0].sum((1, 2)),
        pages_read=counts[:, :, :, 4, 0].sum((1, 2)),
    )


def _check(q, k_cache, v_cache, page_table, store: PageIndexStore, config: LouverConfig) -> None:
    if config.family != "grid" or store.config.family != "grid":
        raise ValueError("the GPU decode path supports the grid family; use family='grid'")
    if store.code_layout != "token":
        raise ValueError("the GPU decode kernels read token-layout codes; make the store with code_layout='token'")
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.dim() != 3 or page_table.dim() != 2:
        raise ValueError("q must be [B, H_q, D], k/v caches [slots, H_kv, D], page_table [B, W]")
    if k_cache.shape[1:] != (store.num_kv_heads, store.head_dim) or q.shape[2] != store.head_dim:
        raise ValueError("q / k_cache do not match the index (H_kv, D)")
    if q.shape[1] % store.num_kv_heads:
        raise ValueError(f"H_q ({q.shape[1]}) must be a multiple of H_kv ({store.num_kv_heads})")
    if store.head_dim not in (64, 128) or v_cache.shape[2] not in (64, 128):
        raise ValueError("the GPU decode kernels support head dims 64 and 128")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k/v caches need a contiguous last dim")
    layout = ("page_size", "grid_bits")
    if any(getattr(config, f) != getattr(store.config, f) for f in layout):
        raise ValueError("config index layout differs from the store's; rebuild the index")
    if getattr(config, "min_sparse_tokens", 0):
        raise ValueError("min_sparse_tokens is a CPU-path setting; the GPU step needs min_sparse_tokens=0")
