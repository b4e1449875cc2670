"""``LouverAttnBackend``: the SGLang attention backend that runs the louver decode step.

It composes: prefill/extend runs in the dense backend SGLang would pick on the device
(``serving.extend``: FlashInfer, FA3 or Triton on CUDA, ``intel_amx`` or ``torch_native`` on
CPU; ``LOUVER_EXTEND_BACKEND`` names another), which also writes K/V; louver then builds the
index of the pages that extend completed. Decode goes through ``LouverDecode`` (plan once per
forward pass, run per layer) over the page index beside the KV pool (``serving.pages``).

On CUDA devices decode runs the Triton implementation through ``CudaDecodePath``: page table,
completed-page builds and the step are static-shape device ops on address-stable buffers, so
SGLang's decode CUDA graphs capture them (graph hooks below).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from ..decode import HeadShapes, LouverDecode
from ..memory import advise_huge_pages
from ..profiles import Shapes
from ..profiles.launch import cpu_threads
from ..settings import Environment
from . import host_tier
from .extend import make_extend_backend
from .options import resolve_options
from .pages import ServingIndex
from .telemetry import Telemetry

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger("louver_sgl.serving")


def indexable(layer) -> bool:
    """Whether louver's decode step serves ``layer`` (decoder self-attention without sliding
    window or logit cap, equal K and V head dims); other layers decode in the extend backend."""
    return (not layer.is_cross_attention and layer.attn_type == AttentionType.DECODER
            and not (layer.sliding_window_size is not None and layer.sliding_window_size > -1)
            and not layer.logit_cap and layer.qk_head_dim == layer.v_head_dim)


class LouverAttnBackend(AttentionBackend):
    """Dense extend in SGLang's backend + louver sparse decode over a radix-shared page index."""

    def __init__(self, model_runner) -> None:
        super().__init__()
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        config, serving, shapes = self._resolve_options(model_runner)
        self.config, self.serving, self.page_size = config, serving, config.page_size
        self.extend_name, self.extend = make_extend_backend(serving.extend_backend, model_runner)
        logger.info("louver: extend (prefill) runs in SGLang's %s backend; decode in louver's %s implementation",
                    self.extend_name, "triton" if self._on_cuda() else "auto")
        # the Triton kernels read token-layout codes (the CPU kernels' default is block16)
        self.index = ServingIndex(config, self.token_to_kv_pool, self.page_size,
                                  "token" if self._on_cuda() else None)
        host_tier.track(self.token_to_kv_pool, self.index)
        self.index.log_memory_estimate()
        server_args = getattr(model_runner, "server_args", None)
        interval = serving.log_interval or int(getattr(server_args, "decode_log_interval", 40) or 40)
        self.telemetry = Telemetry(interval, bool(getattr(server_args, "enable_metrics", False)),
                                   Environment.read().stats_file, config.page_size)
        self.telemetry.index_allocated = self.index.allocated
        self.telemetry.profile = self.selection.message
        if serving.huge_pages:
            self._pool_on_huge_pages()
        self._planned_for = None  # (forward_batch, seq_lens, page table) the CPU wrapper is planned for
        self.cuda_path = self._make_cuda_path(model_runner, shapes)
        self.decode = None if self.cuda_path is not None else LouverDecode(
            config, "cpu", launch={"chunk_pages": serving.chunk_pages}, shapes=shapes)
        self.telemetry.dump()  # the statistics file exists (page size, zero counts) from startup on

    def _resolve_options(self, model_runner):
        """(config, serving options, head shapes) over the tuned profile of this device and the
        served attention shapes; the config takes the server's page size."""
        first = getattr(self.token_to_kv_pool, "start_layer", 0) or 0
        k = self.token_to_kv_pool.get_key_buffer(first)
        v = self.token_to_kv_pool.get_value_buffer(first)
        tp_size = int(getattr(model_runner, "tp_size", 1) or 1)
        heads_q = int(model_runner.model_config.num_attention_heads) // tp_size
        shapes = Shapes(int(k.shape[2]), heads_q, int(k.shape[1]), str(k.dtype).replace("torch.", ""))
        target = "cpu" if k.device.type == "cpu" else "cuda"
        config, serving, selection = resolve_options(target, shapes)
        logger.info("%s", selection.message)
        self.selection = selection
        page_size = int(model_runner.page_size)
        if page_size != config.page_size:
            logger.info("louver: using the server page size %d for the index (configured %d)",
                        page_size, config.page_size)
            config = config.with_(page_size=page_size)
        return config, serving, HeadShapes(heads_q, int(k.shape[1]), int(k.shape[2]), int(v.shape[2]))

    def _on_cuda(self) -> bool:
        return self.token_to_kv_pool.get_key_buffer(self._first_layer()).device.type == "cuda"

    def _pool_on_huge_pages(self) -> None:
        """Move a CPU KV pool's K/V buffers onto transparent huge pages (no-op elsewhere)."""
        pool = self.token_to_kv_pool
        first = self._first_layer()
        if pool.get_key_buffer(first).device.type != "cpu":
            return
        start, moved = time.perf_counter(), 0
        for layer in range(first, first + int(pool.layer_num)):
            for buffer in (pool.get_key_buffer(layer), pool.get_value_buffer(layer)):
                moved += advise_huge_pages(buffer)
        logger.info("louver: %.1f MiB of the KV pool on huge pages (%.1f s)", moved / 2**20,
                    time.perf_counter() - start)

    def _make_cuda_path(self, model_runner, shapes: HeadShapes):
        """The graph-safe Triton decode path on CUDA devices; None on CPU."""
        if not self._on_cuda():
            return None
        from .cuda_path import CudaDecodePath, cuda_launch

        return CudaDecodePath(self.config, cuda_launch(self.selection.profile),
                              int(model_runner.model_config.context_len), shapes, self.device,
                              impl=self.serving.cuda_decode)

    # ----- metadata and CUDA graphs ---------------------------------------------------------------

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        """Eager forwards: the extend backend's metadata for extend batches; for decode batches
        louver's plan (on CUDA into the eager wrapper)."""
        self._planned_for = None
        if forward_batch.forward_mode.is_decode_or_idle():
            if forward_batch.forward_mode.is_decode():
                self._plan(forward_batch, in_graph=False)
            return
        self.extend.init_forward_metadata(forward_batch)

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch):
        """Decode graphs: the page table and lengths of the batch, planned with static-shape
        device ops, recorded in the graph and replayed on the runner's input buffers."""
        if self.cuda_path is not None and forward_batch.forward_mode.is_decode():
            self._plan(forward_batch, in_graph=True)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        if self.cuda_path is None:
            raise NotImplementedError("the CPU decode path is not graph-capturable")
        self.cuda_path.init_graph_state(max_bs)

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def support_triton(self):
        return self.extend.support_triton()

    def _plan(self, forward_batch: ForwardBatch, in_graph: bool) -> None:
        if self.cuda_path is not None:
            self.cuda_path.prepare(self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                                   forward_batch.seq_lens, in_graph)
            return
        page_table, seq_lens = self._page_table(forward_batch)
        with cpu_threads(self.serving.num_threads):  # the plan side is made for the step's thread count
            self.decode.plan(page_table, seq_lens)
        self._planned_for = (forward_batch, seq_lens, page_table)

    # ----- forward -------------------------------------------------------------------------------

    def forward_extend(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache=True, **kw):
        out = self.extend.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kw)
        if indexable(layer) and save_kv_cache:
            self.index.invalidate(layer.layer_id, forward_batch.out_cache_loc)
            self.index.build(layer.layer_id, self._completed_extend_pages(forward_batch))
            if layer.layer_id == self._first_layer():
                self._count_extend(forward_batch)
                self.telemetry.pages_rebuilt_on_read = self.index.pages_rebuilt_on_read
                self.telemetry.dump()
        return out

    def forward_decode(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache=True, **kw):
        if not indexable(layer):
            self.extend.init_forward_metadata(forward_batch)
            return self.extend.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kw)
        if self.cuda_path is not None:
            return self._forward_decode_cuda(q, k, v, layer, forward_batch, save_kv_cache)
        start = time.perf_counter()
        h_q, dim = layer.tp_q_head_num, layer.qk_head_dim
        q = q.reshape(-1, h_q * dim)
        out = torch.empty_like(q)
        if save_kv_cache and k is not None and v is not None:
            self._write_decode_kv(layer, forward_batch, k, v)
        planned = self._planned_for
        if planned is None or planned[0] is not forward_batch or not torch.equal(planned[1], forward_batch.seq_lens.long()):
            self._plan(forward_batch, in_graph=False)  # a caller that skipped init_forward_metadata
        _, seq_lens, page_table = self._planned_for
        self.index.build_unbuilt(layer.layer_id, page_table, seq_lens)
        step_start = time.perf_counter()
        with cpu_threads(self.serving.num_threads):
            stats = self.decode.run(
                q.view(-1, h_q, dim), self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                self.token_to_kv_pool.get_value_buffer(layer.layer_id), self.index.store(layer.layer_id),
                layer.scaling, out=out.view(-1, h_q, dim), stats=True).stats
        step_end = time.perf_counter()
        self.telemetry.record_step(stats, forward_batch.rids)
        if self.serving.step_timing:
            self._time_step(start, step_start, step_end)
        if layer.layer_id == self._first_layer():
            self.telemetry.pages_rebuilt_on_read = self.index.pages_rebuilt_on_read
            self.telemetry.end_decode_forward()
        return out

    def _time_step(self, start: float, step_start: float, step_end: float) -> None:
        """Add one layer's step time and the backend's own time around it (``step_timing``)."""
        timing = self.telemetry.timing
        timing["timed_steps"] += 1
        timing["step_seconds"] += step_end - step_start
        timing["backend_seconds"] += (step_start - start) + (time.perf_counter() - step_end)

    def _write_decode_kv(self, layer, forward_batch: ForwardBatch, k, v) -> None:
        """The decode token's K/V into the pool; the pages it completes are built."""
        self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)
        self.index.invalidate(layer.layer_id, forward_batch.out_cache_loc)
        full = forward_batch.seq_lens % self.page_size == 0
        self.index.build(layer.layer_id, forward_batch.out_cache_loc[full].long() // self.page_size)
        if layer.layer_id == self._first_layer():
            self.telemetry.pages_built += int(full.sum())

    def _forward_decode_cuda(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache):
        """Graph-safe decode: KV write, build of the pages this step completes, Triton step.

        No host reads and no per-layer bookkeeping, so the whole forward can be captured; the
        telemetry counters of the CPU path are not collected here.
        """
        h_q, dim = layer.tp_q_head_num, layer.qk_head_dim
        q3 = q.reshape(-1, h_q, dim)
        out = torch.empty((q3.shape[0], h_q, layer.v_head_dim), dtype=q.dtype, device=q.device)
        store = self.index.store(layer.layer_id)
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buffer = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)
            self.cuda_path.build_completed(store, k_buffer, forward_batch.out_cache_loc, forward_batch.seq_lens)
        self.cuda_path.decode(q3, k_buffer, v_buffer, store, layer.scaling, out)
        return out.view(-1, h_q * layer.v_head_dim)

    # ----- helpers -------------------------------------------------------------------------------

    def _first_layer(self) -> int:
        return getattr(self.token_to_kv_pool, "start_layer", 0) or 0

    def _page_table(self, forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Page ids ``[B, max_pages]`` (int64) of each request's pages and ``seq_lens`` ``[B]``."""
        seq_lens = forward_batch.seq_lens.long()
        max_pages = int((seq_lens.max() + self.page_size - 1) // self.page_size) if len(seq_lens) else 0
        rows = self.req_to_token_pool.req_to_token[forward_batch.req_pool_indices.long()]
        first_slots = rows[:, : max_pages * self.page_size : self.page_size].long()
        return first_slots // self.page_size, seq_lens

    def _completed_extend_pages(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Page ids of pages that became full in this extend (not those of the cached prefix)."""
        size = self.page_size
        req_to_token = self.req_to_token_pool.req_to_token
        pages = []
        rows = forward_batch.req_pool_indices.tolist()
        for row, start, end in zip(rows, forward_batch.extend_prefix_lens.tolist(), forward_batch.seq_lens.tolist()):
            first, last = start // size, end // size  # pages [first, last) are full after this forward
            if last > first:
                pages.append(req_to_token[row, first * size : last * size : size].long() // size)
        return torch.cat(pages) if pages else torch.zeros(0, dtype=torch.long)

    def _count_extend(self, forward_batch: ForwardBatch) -> None:
        size = self.page_size
        starts, ends = forward_batch.extend_prefix_lens.tolist(), forward_batch.seq_lens.tolist()
        rids = forward_batch.rids if forward_batch.rids and len(forward_batch.rids) == len(starts) else [None] * len(starts)
        for rid, start, end in zip(rids, starts, ends):
            self.telemetry.count_prefill(rid, end // size - start // size, start // size)
