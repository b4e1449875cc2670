"""The louver decode step inside SGLang on CUDA, with address-stable buffers for decode graphs.

SGLang captures one decode graph per batch size and replays it with new metadata. Everything
here that runs per step is a static-shape device op: the page table is gathered from
``req_to_token`` on the device and planned into the graph wrapper's workspace (allocated once for
the graphs' largest batch), the page a decode step completes is built by a fixed-size Triton build
(placeholder ids are skipped), and the decode kernels read the sequence lengths on the device.
Nothing reads a device value on the host, so the same calls run eagerly and under capture.
Batches outside the graphs (eager forwards, larger batches) plan into a second wrapper whose
workspace grows as needed, so the graphs' buffers never move. With ``cuda_decode=auto`` the
implementation of each batch size comes from the CUDA profile's dispatch rules
(``decode.dispatch``); a graph captured for a batch size keeps that choice.

Telemetry follows the same rule: each step's statistics and the pages it builds are summed on
the device (``DeviceCounts``) and read on the host only when the telemetry is read, at the start
of a decode forward (an eager one, or a graph replay) every ``interval`` forwards or with a
statistics file. The index's built-page mask is kept by the same device ops.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from louver_kernels.triton.grid_build import grid_build
from louver_kernels.triton.launch import TritonLaunch

from ..config import LouverConfig
from ..decode import DecodeResult, HeadShapes, LouverDecode
from ..decode import dispatch
from ..index.store import PageIndexStore
from .decode_path import DecodeForward, DecodePath, ServingState
from .telemetry import DeviceCounts


def cuda_launch_section(profile) -> dict[str, Any]:
    """The kernel part of a CUDA profile's launch section (shared fields, per-implementation
    objects, dispatch rules; empty without one)."""
    if profile is None or profile.target != "cuda":
        return {}
    known = dispatch.kernel_keys()  # the rest are serving options
    return {k: v for k, v in profile.launch.items() if k in known}


def cuda_launch(profile, impl: str = "triton") -> TritonLaunch:
    """``impl``'s Triton launch parameters from a CUDA profile (defaults without one)."""
    return dispatch.launch_for(cuda_launch_section(profile), impl)


class CudaDecodePath(DecodePath):
    """Graph-safe metadata, page builds and decode steps of the louver backend on CUDA.

    ``state`` (the backend's pools, index and telemetry) is needed by the serving methods
    (``prepare``, ``run_layer``, ``report``), not by the batch-level ones the tests drive.
    """

    graph_capturable = True

    def __init__(self, config: LouverConfig, launch: TritonLaunch | Mapping[str, Any], max_context: int,
                 shapes: HeadShapes, device, impl: str = "triton", state: ServingState | None = None) -> None:
        """``launch``: one ``TritonLaunch`` for every implementation, or a CUDA profile's launch
        section (``cuda_launch_section``: per-implementation launches and dispatch rules).
        ``impl``: an implementation, or ``auto`` (the section's rules choose per batch size)."""
        if not config.grid_codes:
            raise ValueError("the CUDA decode path runs the grid family")
        self.config, self.shapes, self.impl = config, shapes, impl
        self.section = None if isinstance(launch, TritonLaunch) else dict(launch)
        self.single_launch = launch if isinstance(launch, TritonLaunch) else None
        self.rules = dispatch.parse_rules(self.section)
        self.max_context = max_context
        self.page_size = config.page_size
        self.max_pages = math.ceil(max_context / self.page_size)
        self.device = torch.device(device)
        self.eagers: dict[str, LouverDecode] = {}
        self.graphs: dict[str, LouverDecode] = {}
        self.eager = self._eager(self.implementation(1))
        self.graph: LouverDecode | None = None
        self.active = self.eager
        self.build_ids: torch.Tensor | None = None
        self.state = state
        self.counts = DeviceCounts(self.device)
        self.captured = False  # graphs were captured since the last count (their warm-up runs counted)
        if state is not None:
            state.telemetry.collect = self._collect

    # ----- the serving interface (DecodePath) -----------------------------------------------------

    def prepare(self, forward_batch, in_graph: bool = False) -> DecodeForward:
        """Plan a decode forward; an eager one also ends the previous forward's accounting."""
        if not in_graph:
            self.report()
        self.plan_batch(self.state.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                        forward_batch.seq_lens, in_graph)
        return DecodeForward(forward_batch, forward_batch.seq_lens)

    def replayed(self, in_capture: bool) -> None:
        """The host side of a decode graph's capture (``in_capture``) or replay: a replay counts
        as a decode forward; the counts of capture warm-ups are dropped."""
        if in_capture:
            self.captured = True
            return
        self.report()

    def run_layer(self, q, k, v, layer, forward_batch, save_kv_cache: bool) -> torch.Tensor:
        """KV write, build of the pages this step completes, Triton step, device-side counts.

        No host reads, so the whole forward can be captured.
        """
        state, layer_id = self.state, layer.layer_id
        h_q, dim = layer.tp_q_head_num, layer.qk_head_dim
        q3 = q.reshape(-1, h_q, dim)
        out = torch.empty((q3.shape[0], h_q, layer.v_head_dim), dtype=q.dtype, device=q.device)
        store = state.index.store(layer_id)
        k_buffer, v_buffer = state.key_buffer(layer_id), state.value_buffer(layer_id)
        if save_kv_cache and k is not None and v is not None:
            state.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)
            done = self.build_completed(store, k_buffer, forward_batch.out_cache_loc, forward_batch.seq_lens)
            page = torch.div(forward_batch.out_cache_loc.long(), self.page_size, rounding_mode="floor")
            state.index.built[layer_id][page] = done  # a written page is built iff this step completed it
            if layer_id == state.first_layer:
                self.counts.add_pages_built(done.sum())
        self.counts.add(self.decode(q3, k_buffer, v_buffer, store, layer.scaling, out, stats=True).stats)
        return out.view(-1, h_q * layer.v_head_dim)

    def report(self) -> None:
        if self.captured:  # capture's warm-up forwards ran on placeholder batches
            self.counts.drain()
            self.captured = False
        if self.state is not None:
            self.state.telemetry.end_decode_forward()

    def _collect(self) -> None:
        """The device counts into the telemetry's window (``Telemetry.collect``)."""
        counts, built = self.counts.drain()
        telemetry = self.state.telemetry
        telemetry.window.merge(counts)
        telemetry.pages_built += built

    # ----- batch-level steps ---------------------------------------------------------------------

    def implementation(self, batch: int) -> str:
        """The implementation a batch of ``batch`` requests runs."""
        if self.impl != "auto":
            return self.impl
        rows = batch * self.shapes.num_kv_heads
        return dispatch.choose(self.rules, self.config.threshold.kind, rows, self.max_context)

    def launch(self, impl: str) -> TritonLaunch:
        return self.single_launch or dispatch.launch_for(self.section, impl)

    def _eager(self, impl: str) -> LouverDecode:
        if impl not in self.eagers:
            self.eagers[impl] = LouverDecode(self.config, self.device, impl=impl, launch=self.launch(impl),
                                             shapes=self.shapes)
        return self.eagers[impl]

    def init_graph_state(self, max_bs: int) -> None:
        """The graph wrappers for batches up to ``max_bs``, one per implementation some batch size
        runs (their workspaces allocated here, once)."""
        if self.graph is None or self.graph.impl.capacity.max_batch < max_bs:
            self.graphs = {impl: LouverDecode(self.config, self.device, impl=impl, launch=self.launch(impl),
                                              shapes=self.shapes, max_batch=max_bs, max_pages=self.max_pages)
                           for impl in sorted({self.implementation(bs) for bs in range(1, max_bs + 1)})}
            self.graph = self.graphs[self.implementation(max_bs)]
            self.build_ids = torch.full((max_bs,), -1, dtype=torch.int64, device=self.device)

    def plan_batch(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                   in_graph: bool) -> int:
        """Plan a decode batch (static-shape device ops) into the graph wrapper (``in_graph``) or
        the eager one.

        Args:
            req_to_token: ``[max_reqs, max_context]`` int32 slot of every position of every request.
            req_pool_indices: ``[bs]`` row of each request; seq_lens: ``[bs]`` tokens per request.
        Returns the batch size.
        """
        bs = seq_lens.shape[0]
        impl = self.implementation(bs)
        if in_graph:
            self.init_graph_state(bs)
            self.graph = self.graphs[impl]
        self.active = self.graph if in_graph else self._eager(impl)
        size = self.page_size
        first_slots = req_to_token[req_pool_indices.long(), : self.max_pages * size : size]
        self.active.plan(torch.div(first_slots, size, rounding_mode="floor"), seq_lens)
        return bs

    def build_completed(self, store: PageIndexStore, k_buffer: torch.Tensor, out_cache_loc: torch.Tensor,
                        seq_lens: torch.Tensor) -> torch.Tensor:
        """Build the page each request completed in this step (its last slot was just written).

        out_cache_loc ``[bs]`` slot written per request; seq_lens ``[bs]`` lengths including it.
        Returns ``[bs]`` bool: which requests completed their page.
        """
        bs = seq_lens.shape[0]
        if self.active is self.graph:  # the graphs' own buffer (its address is captured)
            ids = self.build_ids[:bs]
        else:
            ids = torch.empty(bs, dtype=torch.int64, device=self.device)
        done = torch.remainder(seq_lens, self.page_size) == 0
        page = torch.div(out_cache_loc.long(), self.page_size, rounding_mode="floor")
        torch.where(done, page, torch.full_like(page, -1), out=ids)
        if store.code_layout != "token":
            raise ValueError("the Triton page build writes token-layout codes; make the store with code_layout='token'")
        t = store.tensors
        grid_build(k_buffer, ids, t["lo"], t["scale"], t["radius"], t["codes"], self.page_size,
                   self.config.grid_bits, self.active.impl.launch)
        return done

    def decode(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, store: PageIndexStore,
               sigma: float, out: torch.Tensor, stats: bool = False) -> DecodeResult:
        """One louver step for the prepared batch: q ``[bs, H_q, D]`` -> ``out`` ``[bs, H_q, D_v]``
        (and the step's ``StepStats``, device tensors, with ``stats``)."""
        return self.active.run(q, k_buffer, v_buffer, store, sigma, out=out, stats=stats)
