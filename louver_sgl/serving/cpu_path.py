"""The louver decode step inside SGLang on CPU: planned on the host once per forward, run per layer.

The compiled CPU implementation (or the torch one where it does not build) runs each indexed
layer's step on the plan of the forward; pages a decode token completes are built on the host,
and full pages read but not built (written outside the backend, loaded back from the host tier)
are built before the step reads them. Every step's ``StepStats`` goes to the telemetry with the
batch's request ids, so the statistics file keeps per-request accounts.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from ..config import LouverConfig
from ..decode import HeadShapes, LouverDecode
from ..profiles.launch import cpu_threads
from ..settings import ServingOptions
from .decode_path import DecodeForward, DecodePath, ServingState

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


class CpuDecodePath(DecodePath):
    """Host-planned decode through ``LouverDecode`` on the CPU (not graph-capturable)."""

    def __init__(self, config: LouverConfig, serving: ServingOptions, shapes: HeadShapes,
                 state: ServingState) -> None:
        self.serving, self.state = serving, state
        self.decode = LouverDecode(config, "cpu", launch={"chunk_pages": serving.chunk_pages}, shapes=shapes)
        self.forward: DecodeForward | None = None

    def prepare(self, forward_batch: ForwardBatch, in_graph: bool = False) -> DecodeForward:
        if in_graph:
            raise NotImplementedError("the CPU decode path is not graph-capturable")
        page_table, seq_lens = self._page_table(forward_batch)
        with cpu_threads(self.serving.num_threads):  # the plan side is made for the step's thread count
            self.decode.plan(page_table, seq_lens)
        self.forward = DecodeForward(forward_batch, seq_lens, page_table)
        return self.forward

    def run_layer(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache: bool) -> torch.Tensor:
        start = time.perf_counter()
        state, layer_id = self.state, layer.layer_id
        h_q, dim = layer.tp_q_head_num, layer.qk_head_dim
        q = q.reshape(-1, h_q * dim)
        out = torch.empty_like(q)
        if save_kv_cache and k is not None and v is not None:
            self._write_kv(layer, forward_batch, k, v)
        forward = self.forward
        if forward is None or forward.batch is not forward_batch:
            forward = self.prepare(forward_batch)  # a caller that skipped init_forward_metadata
        state.index.build_unbuilt(layer_id, forward.page_table, forward.seq_lens)
        step_start = time.perf_counter()
        with cpu_threads(self.serving.num_threads):
            stats = self.decode.run(
                q.view(-1, h_q, dim), state.key_buffer(layer_id), state.value_buffer(layer_id),
                state.index.store(layer_id), layer.scaling, out=out.view(-1, h_q, dim), stats=True).stats
        step_end = time.perf_counter()
        state.telemetry.record_step(stats, forward_batch.rids)
        if self.serving.step_timing:
            self._time_step(start, step_start, step_end)
        if layer_id == state.first_layer:
            self.report()
        return out

    def report(self) -> None:
        telemetry = self.state.telemetry
        telemetry.pages_rebuilt_on_read = self.state.index.pages_rebuilt_on_read
        telemetry.end_decode_forward()

    def _write_kv(self, layer, forward_batch: ForwardBatch, k, v) -> None:
        """The decode token's K/V into the pool; the pages it completes are built."""
        state, size = self.state, self.state.page_size
        state.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)
        state.index.invalidate(layer.layer_id, forward_batch.out_cache_loc)
        full = forward_batch.seq_lens % size == 0
        state.index.build(layer.layer_id, forward_batch.out_cache_loc[full].long() // size)
        if layer.layer_id == state.first_layer:
            state.telemetry.pages_built += int(full.sum())

    def _time_step(self, start: float, step_start: float, step_end: float) -> None:
        """Add one layer's step time and the backend's own time around it (``step_timing``)."""
        timing = self.state.telemetry.timing
        timing["timed_steps"] += 1
        timing["step_seconds"] += step_end - step_start
        timing["backend_seconds"] += (step_start - start) + (time.perf_counter() - step_end)

    def _page_table(self, forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Page ids ``[B, max_pages]`` (int64) of each request's pages and ``seq_lens`` ``[B]``."""
        size = self.state.page_size
        seq_lens = forward_batch.seq_lens.long()
        max_pages = int((seq_lens.max() + size - 1) // size) if len(seq_lens) else 0
        rows = self.state.req_to_token_pool.req_to_token[forward_batch.req_pool_indices.long()]
        first_slots = rows[:, : max_pages * size : size].long()
        return first_slots // size, seq_lens
