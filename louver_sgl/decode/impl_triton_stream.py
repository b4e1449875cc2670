"""The ``triton_stream`` decode implementation: filter pass with compacted survivors, then
split-K attention over them (``louver_kernels.triton.stream_decode``).

Launches: the threshold pass of ``triton`` (``exact_part``; certified: ``certified_hist`` and
``certified_threshold``) -> ``filter_survivors`` (page bounds, token bounds, GQA union; every
(request, KV head, segment) compacts its survivors into its list) -> fallback flags (union over
the dense-fallback fraction, or a segment list past its capacity) -> ``attend_survivors``
(the request's survivors shared evenly by the splits) -> the dense fallback pass where a request
can be flagged -> ``merge``. The a-posteriori certified rule runs ``triton``'s fused step: its
band pass must evaluate the first pass's bounds bit for bit, which the fused kernels do by
running both passes in one binary (a band over the filter's lists would recompute the bounds in
another kernel, whose sums may round otherwise). Same contract, statistics and workspace as ``triton``, plus the
survivor lists, allocated with it; nothing reads the device on the host. With
``certified_passes=1`` the threshold launches are the one-pass rule's (``_one_pass_thresholds``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import threshold as th
from .contract import BUDGET_SAFETY, EDGES, FP64_SUM_DOWN, HIST_ROUNDING, VALUE_GATE, RequestLayout
from .impl_triton import GpuWorkspace, TritonDecode, dense_fallback_pass, fallback_flags, threshold_stages

from louver_kernels.triton import grid_decode as kern  # noqa: E402 (after the project's own imports)
from louver_kernels.triton import stream_decode as stream  # noqa: E402


@dataclass
class SurvivorLists:
    """Per (request, KV head, segment) survivor lists of capacity C, for up to ``max_batch``
    requests and ``splits`` segments (``grid_decode.num_splits`` of the page-table width)."""

    slot: torch.Tensor  # [Bmax, H_kv, S, C] int32: KV slot of each survivor
    heads: torch.Tensor  # [Bmax, H_kv, S, C] int32: head mask (bit g: query head g; bit 30: indexed)
    count: torch.Tensor  # [Bmax, H_kv, S] int32: survivors per segment (> C: overflowed)
    peak: torch.Tensor  # [Bmax] int32: the request's largest segment count
    overflow: torch.Tensor  # [Bmax] bool: some segment of the request overflowed
    dropped64: torch.Tensor  # [Bmax, H_kv, S, BG] fp64: dropped-mass bound per segment (one-pass rule)
    provisional: torch.Tensor  # [Bmax, H_q] fp32: the one-pass rule's T_p
    failed: torch.Tensor  # [Bmax] bool: requests whose one-pass check failed
    pos: torch.Tensor | None = None  # [Bmax, H_kv, S, C] int32: token positions (audits only)

    @classmethod
    def allocate(cls, max_batch: int, heads_kv: int, splits: int, capacity: int, block_g: int, heads_q: int,
                 device) -> "SurvivorLists":
        shape = (max_batch, heads_kv, splits, capacity)
        return cls(slot=torch.zeros(shape, dtype=torch.int32, device=device),
                   heads=torch.zeros(shape, dtype=torch.int32, device=device),
                   count=torch.zeros(shape[:3], dtype=torch.int32, device=device),
                   peak=torch.zeros(max_batch, dtype=torch.int32, device=device),
                   overflow=torch.zeros(max_batch, dtype=torch.bool, device=device),
                   dropped64=torch.zeros(*shape[:3], block_g, dtype=torch.float64, device=device),
                   provisional=torch.zeros(max_batch, heads_q, dtype=torch.float32, device=device),
                   failed=torch.zeros(max_batch, dtype=torch.bool, device=device))

    def view(self, batch: int) -> "SurvivorLists":
        fields = {k: v[:batch] for k, v in self.__dict__.items() if isinstance(v, torch.Tensor)}
        return SurvivorLists(**fields)

    def with_positions(self) -> "SurvivorLists":
        if self.pos is None:
            self.pos = torch.zeros_like(self.slot)
        return self

    def as_kernel_args(self) -> dict:
        return dict(slot=self.slot, heads=self.heads, count=self.count, pos=self.pos)


class TritonStreamDecode(TritonDecode):
    """``triton``'s contract with the filter and the attention in separate, evenly parallel
    passes (module docstring). Graph-safe under the same conditions as ``triton``."""

    name = "triton_stream"
    one_pass_certified = True

    def __init__(self, config, device, launch, shapes, capacity) -> None:
        super().__init__(config, device, launch, shapes, capacity)
        if shapes is not None and shapes.num_q_heads // shapes.num_kv_heads > stream.MAX_GROUP:
            raise ValueError(f"the {self.name!r} kernels hold at most {stream.MAX_GROUP} query heads per KV head")
        self.lists: SurvivorLists | None = None
        if self.workspace is not None:
            self.lists = self._allocate_lists(self.workspace)

    def _allocate_lists(self, ws: GpuWorkspace) -> SurvivorLists:
        capacity = stream.segment_capacity(self.launch, self.config.page_size)
        return SurvivorLists.allocate(ws.max_batch, ws.m.shape[1], ws.m.shape[2], capacity, ws.m.shape[3],
                                      ws.ref.shape[1], self.device)

    def stages(self, q, k_cache, v_cache, ws: GpuWorkspace, store, sigma: float, out, keep) -> list:
        if self.config.threshold.band_pass:
            # the band pass must see the first pass's bounds bit for bit; the fused kernels run both
            # passes in one binary, the filter kernel and the fused band kernel are two
            return super().stages(q, k_cache, v_cache, ws, store, sigma, out, keep)
        if q.shape[1] // k_cache.shape[1] > stream.MAX_GROUP:
            raise ValueError(f"the {self.name!r} kernels hold at most {stream.MAX_GROUP} query heads per KV head")
        full = self.workspace
        if self.lists is None or self.lists.slot.shape[:3] != full.m.shape[:3]:
            self.lists = self._allocate_lists(full)  # the workspace was (re)allocated by plan
        lists = self.lists.with_positions().view(ws.max_batch) if keep is not None else self.lists.view(ws.max_batch)
        return stream_stages(q, k_cache, v_cache, ws, lists, store, sigma, self.config, self.launch, out, keep)


def stream_stages(q, k_cache, v_cache, ws: GpuWorkspace, lists: SurvivorLists, store, sigma: float, config,
                  launch, out, keep) -> list:
    """The launches of one streaming step (module docstring) as named stages."""
    h_kv = k_cache.shape[1]
    layout = RequestLayout.of(config).constexprs()
    filter_args = (q, ws.page_table, ws.seq_lens, store.tensors, ws.threshold, ws.ref, lists.as_kernel_args(),
                   ws.counts, ws.mass, sigma, layout, config.min_sparse_tokens, config.grid_bits, launch)
    if config.threshold.one_pass:
        stages = [("one_pass_thresholds_and_filter", lambda: _one_pass_thresholds(
            q, k_cache, ws, lists, store, sigma, config, launch, filter_args, keep is not None))]
    else:
        stages = threshold_stages(q, k_cache, ws, store, sigma, config, launch)
        stages.append(("filter", lambda: stream.filter_survivors(*filter_args, positions=keep is not None)))

    def flags() -> None:
        torch.amax(lists.count.flatten(1), dim=1, out=lists.peak)
        torch.gt(lists.peak, lists.slot.shape[3], out=lists.overflow)
        _flags(ws, lists, config, h_kv)

    stages.append(("fallback_flags", flags))
    stages.append(("attend", lambda: stream.attend_survivors(
        q, k_cache, v_cache, lists.as_kernel_args(), ws.threshold, ws.ref, ws.fallback, ws.m, ws.l, ws.o, ws.counts,
        ws.mass, ws.z_own, sigma, config.threshold.gates_values, VALUE_GATE.rel, kern._kv_dtype(k_cache), launch,
        attended=keep)))
    if config.dense_fallback_fraction < 1.0 or launch.survivor_percent < 100:  # a request can be flagged
        stages.append(("dense_fallback", lambda: dense_fallback_pass(q, k_cache, v_cache, ws, store, sigma, config,
                                                                     launch, keep)))
    stages.append(("merge", lambda: kern.merge(ws.m, ws.l, ws.o, ws.z_own, out, ws.z_att, sigma, FP64_SUM_DOWN,
                                               launch)))
    return stages


def _flags(ws: GpuWorkspace, lists: SurvivorLists, config, h_kv: int) -> None:
    """ws.fallback: union over the dense-fallback fraction, or a survivor list past its capacity."""
    fallback_flags(ws, RequestLayout.of(config), h_kv, config.dense_fallback_fraction)
    ws.fallback.logical_or_(lists.overflow)


def _one_pass_thresholds(q, k_cache, ws: GpuWorkspace, lists: SurvivorLists, store, sigma: float, config, launch,
                         filter_args: tuple, positions: bool) -> None:
    """The one-pass certified rule (``threshold.safe_level`` / ``provisional_certified``): T_p,
    the filter at T_p with its fp64 dropped mass, the check on the device; requests with a head
    whose check fails take the histogram rule (the histogram and the filter again, launched for
    every request but doing work only for the flagged ones: graph-safe, no host read)."""
    h_kv = k_cache.shape[1]
    layout = RequestLayout.of(config).constexprs()
    lens, table = ws.seq_lens, ws.page_table
    eps_budget = config.eps * BUDGET_SAFETY
    kern.exact_part(q, k_cache, table, lens, ws.ref, ws.z_lb, ws.sample, sigma, layout, config.min_sparse_tokens,
                    FP64_SUM_DOWN, launch=launch, hist=ws.hist, habs=ws.habs)
    n_indexed = RequestLayout.of(config).indexed_tokens(lens)
    lists.provisional.copy_(th.safe_level(ws.ref, ws.z_lb, n_indexed, sigma, eps_budget, HIST_ROUNDING))
    ws.threshold.copy_(lists.provisional)
    stream.filter_survivors(*filter_args, positions=positions, dropped64=lists.dropped64)
    batch, heads = ws.ref.shape
    dropped = lists.dropped64[..., : heads // h_kv].sum(2).reshape(batch, heads)
    ok, certificate = th.provisional_certified(dropped, ws.z_lb, eps_budget, HIST_ROUNDING)
    torch.logical_not(ok, out=ws.lowered)
    torch.logical_not(ok.all(dim=1), out=lists.failed)
    kern.certified_hist(q, table, lens, store.tensors, ws.ref, ws.hist, ws.habs, sigma, layout,
                        config.min_sparse_tokens, config.grid_bits, EDGES, launch, flagged=lists.failed)
    kern.certified_threshold(ws.hist, ws.habs, ws.ref, ws.z_lb, ws.threshold, ws.certificate, sigma, eps_budget,
                             HIST_ROUNDING, h_kv, EDGES, launch)
    failed = lists.failed[:, None]
    ws.threshold.copy_(torch.where(failed, ws.threshold, lists.provisional))
    ws.certificate.copy_(torch.where(failed, ws.certificate, certificate))
    stream.filter_survivors(*filter_args, positions=positions, flagged=lists.failed)
