"""The louver decode step inside SGLang on CPU: planned on the host once per forward, run per layer.

The compiled CPU implementation (or the torch one where it does not build) runs each indexed
layer's step on the plan of the forward; pages a decode token completes are built on the host,
and full pages read but not built (written outside the backend, loaded back from the host tier)
are built before the step reads them. Every step's ``StepStats`` goes to the telemetry with the
batch's request ids, so the statistics file keeps per-request accounts.

Requests that chose their own accuracy (``request_policy``) share the forward with the others:
the batch is split into one group per distinct policy, each planned and run by a ``LouverDecode``
of its own config over the group's rows, and the outputs land in the batch's rows.

Under a config with ``estimate_share_max`` (``LouverConfig.adaptive_share``) each request's
a-posteriori estimate share is adapted per layer from its own steps' checks
(``decode.share_control``), keyed by request id and layer.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from ..config import LouverConfig
from ..decode import HeadShapes, LouverDecode
from ..decode.share_control import ShareControl
from ..profiles.launch import cpu_threads
from ..settings import ServingOptions
from .decode_path import DecodeForward, DecodePath, ServingState
from .request_policy import describe, requests_of

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


MAX_POLICY_DECODES = 16  # decode objects kept for per-request configs (least recently used dropped)


def _kept(cache: OrderedDict, key, make, capacity: int):
    """``cache[key]`` (``make()`` where absent) as the most recently used entry, the least recently
    used dropped past ``capacity``."""
    value = cache.pop(key, None)
    if value is None:
        value = make()
    cache[key] = value
    while len(cache) > capacity:
        cache.popitem(last=False)
    return value


@dataclass(frozen=True)
class DecodeGroup:
    """The requests of a decode forward that run one config: ``rows`` ``[b]`` int64 of the batch
    (None: every row), their ``LouverDecode`` (planned on those rows) and request ids."""

    rows: torch.Tensor | None
    decode: LouverDecode
    rids: list | None


class CpuDecodePath(DecodePath):
    """Host-planned decode through ``LouverDecode`` on the CPU (not graph-capturable)."""

    def __init__(self, config: LouverConfig, serving: ServingOptions, shapes: HeadShapes,
                 state: ServingState) -> None:
        self.serving, self.state, self.shapes = serving, state, shapes
        self.decode = self._make_decode(config)
        self.policy_decodes: OrderedDict[LouverConfig, LouverDecode] = OrderedDict()
        # per adaptive config, as many as decode objects (least recently used dropped)
        self.share_controls: OrderedDict[LouverConfig, ShareControl] = OrderedDict()
        self.forward: DecodeForward | None = None
        self.groups: tuple[DecodeGroup, ...] = ()
        # per forward, the same for every layer (prepare): the pages the decode tokens write, the
        # pages they complete, the full pages the steps read and whether every layer has them built
        self.written = self.completed = self.needed = None
        self.all_built, self.invalidations = False, 0

    def _make_decode(self, config: LouverConfig) -> LouverDecode:
        launch = {"chunk_pages": self.serving.chunk_pages, "one_scan": self.serving.one_scan,
                  "residual_weights": self.serving.residual_weights}
        return LouverDecode(config, "cpu", launch=launch, shapes=self.shapes)

    def prepare(self, forward_batch: ForwardBatch, in_graph: bool = False) -> DecodeForward:
        if in_graph:
            raise NotImplementedError("the CPU decode path is not graph-capturable")
        page_table, seq_lens = self._page_table(forward_batch)
        groups = self._groups(forward_batch)
        with cpu_threads(self.serving.num_threads):  # the plan side is made for the step's thread count
            for group in groups:
                rows = group.rows
                group.decode.plan(page_table if rows is None else page_table[rows],
                                  seq_lens if rows is None else seq_lens[rows])
        self.groups = groups
        self._pages_of(forward_batch, page_table, seq_lens)
        self.forward = DecodeForward(forward_batch, seq_lens, page_table)
        return self.forward

    def _pages_of(self, forward_batch: ForwardBatch, page_table: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """The forward's page sets, once for all its layers: each layer's own torch calls on the
        decode path cost microseconds apiece once its step has swept the caches."""
        index, size = self.state.index, self.state.page_size
        self.written = forward_batch.out_cache_loc.long() // size
        self.completed = self.written[seq_lens % size == 0]
        self.needed = index.full_pages(page_table, seq_lens)
        self.all_built, self.invalidations = index.all_built(self.needed), index.invalidations

    def _groups(self, forward_batch: ForwardBatch) -> tuple[DecodeGroup, ...]:
        """One group per distinct policy of the batch's requests (one, of the server's config, when
        no request chose its own); each request's policy is noted in its account."""
        rids = forward_batch.rids if forward_batch.rids and len(forward_batch.rids) == len(forward_batch.seq_lens) \
            else None
        policies = requests_of(forward_batch, len(forward_batch.seq_lens))
        telemetry, server = self.state.telemetry, self.decode.config
        if policies is None:
            telemetry.note_policies(rids, describe(server, own=False))
            return (DecodeGroup(None, self.decode, rids),)
        rows_of: dict[LouverConfig, list[int]] = {}
        for row, policy in enumerate(policies):
            rows_of.setdefault(server if policy is None else policy.apply(server), []).append(row)
        groups = []
        for config, rows in rows_of.items():
            group_rids = [rids[r] for r in rows] if rids else None
            for own in (False, True):  # a request that asked for the server's own values says so
                mine = [rids[r] for r in rows if (policies[r] is not None) == own] if rids else None
                telemetry.note_policies(mine, describe(config, own=own))
            groups.append(DecodeGroup(torch.tensor(rows, dtype=torch.long), self._decode_for(config), group_rids))
        telemetry.mixed_policy_forwards += len(groups) > 1
        return tuple(groups)

    def _decode_for(self, config: LouverConfig) -> LouverDecode:
        """The decode object of ``config`` (the server's, or one kept per request config)."""
        if config == self.decode.config:
            return self.decode
        return _kept(self.policy_decodes, config, lambda: self._make_decode(config), MAX_POLICY_DECODES)

    def run_layer(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache: bool) -> torch.Tensor:
        start = time.perf_counter()
        state, layer_id = self.state, layer.layer_id
        h_q, dim = layer.tp_q_head_num, layer.qk_head_dim
        q = q.reshape(-1, h_q * dim)
        out = torch.empty_like(q)
        forward = self.forward
        if forward is None or forward.batch is not forward_batch:
            forward = self.prepare(forward_batch)  # a caller that skipped init_forward_metadata
        if save_kv_cache and k is not None and v is not None:
            self._write_kv(layer, forward_batch, k, v)
        # (the pages this forward's own writes complete are built by them; a write by slot since
        # prepare, e.g. a host-tier load, voids its check)
        if not self.all_built or state.index.invalidations != self.invalidations:
            state.index.build_unbuilt(layer_id, forward.page_table, forward.seq_lens, self.needed)
        step_start = time.perf_counter()
        q3, out3 = q.view(-1, h_q, dim), out.view(-1, h_q, dim)
        caches = (state.key_buffer(layer_id), state.value_buffer(layer_id), state.index.store(layer_id))
        with cpu_threads(self.serving.num_threads):
            for group in self.groups:
                rows = group.rows
                control, keys = self._shares_of(group, layer_id)
                result = group.decode.run(q3 if rows is None else q3[rows], *caches, layer.scaling,
                                          out=out3 if rows is None else None, stats=True,
                                          estimate_share=None if control is None else control.shares(keys))
                if control is not None:
                    control.update_step(keys, result.stats)
                if rows is not None:
                    out3[rows] = result.out
                state.telemetry.record_step(result.stats, group.rids, layer_id)
        step_end = time.perf_counter()
        if self.serving.step_timing:
            self._time_step(start, step_start, step_end)
        if layer_id == state.first_layer:
            self.report()
        return out

    def _shares_of(self, group: DecodeGroup, layer_id: int) -> tuple[ShareControl | None, list]:
        """The share control of the group's config and its (request id, layer) keys; (None, [])
        where the config keeps one share or the batch has no request ids."""
        config = group.decode.config
        if not config.adaptive_share or not group.rids:
            return None, []
        # one per decode object: the server's config and the kept ones
        control = _kept(self.share_controls, config, lambda: ShareControl(config), MAX_POLICY_DECODES + 1)
        return control, [(rid, layer_id) for rid in group.rids]

    def report(self) -> None:
        telemetry = self.state.telemetry
        telemetry.pages_rebuilt_on_read = self.state.index.pages_rebuilt_on_read
        telemetry.end_decode_forward()

    def _write_kv(self, layer, forward_batch: ForwardBatch, k, v) -> None:
        """The decode token's K/V into the pool; the pages it completes are built."""
        state = self.state
        state.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)
        state.index.invalidate_pages(layer.layer_id, self.written)
        state.index.build(layer.layer_id, self.completed)
        if layer.layer_id == state.first_layer:
            state.telemetry.pages_built += int(self.completed.numel())

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
