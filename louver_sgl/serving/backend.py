"""``LouverAttnBackend``: SGLang attention backend running the louver decode step.

Prefill/extend is dense and delegated to SGLang's ``torch_native`` backend (which also writes
K/V). The index lives beside the KV pool in one ``PageIndexStore`` per layer, indexed by page id
(= slot // page_size), so a request whose prefix matched in the radix cache reads the pages'
index already built by the first request. Lifecycle: any write into a page invalidates its index;
a page is built when it becomes full inside the forward that fills it (extend pages completed by
``[prefix_len, seq_len)``, decode when ``seq_len % P == 0``); a full page found unbuilt when read
(pages written outside this backend, e.g. by tests) is built then.

On CUDA devices decode runs the Triton step through ``CudaDecodePath`` (``cuda_path.py``): page
table, completed-page builds and the step are static-shape device ops on address-stable buffers,
so SGLang's decode CUDA graphs capture them (graph hooks below).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from ..index.store import PageIndexStore
from ..memory import advise_huge_pages
from ..decode import louver_decode
from ..decode.plan import plan_decode
from ..profiles import Shapes
from ..profiles.launch import cpu_threads
from .options import resolve_options
from .telemetry import Telemetry

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger("louver_sgl.serving")


class LouverAttnBackend(TorchNativeAttnBackend):
    """Dense extend (torch SDPA) + louver sparse decode over a radix-shared page index."""

    def __init__(self, model_runner) -> None:
        super().__init__(model_runner)
        config, serving = self._resolve_options(model_runner)
        page_size = int(model_runner.page_size)
        if page_size != config.page_size:
            logger.info("louver: using the server page size %d for the index (configured %d)",
                        page_size, config.page_size)
            config = config.with_(page_size=page_size)
        self.config, self.serving = config, serving
        self.page_size = page_size
        self.stores: dict[int, PageIndexStore] = {}
        self.built: dict[int, torch.Tensor] = {}
        self._decode_plan = None  # (forward_batch, page table, seq_lens, DecodePlan) of the current forward
        server_args = getattr(model_runner, "server_args", None)
        interval = serving.log_interval or int(getattr(server_args, "decode_log_interval", 40) or 40)
        self.telemetry = Telemetry(interval, bool(getattr(server_args, "enable_metrics", False)))
        self._log_memory_estimate()
        if serving.huge_pages:
            self._pool_on_huge_pages()
        self.cuda_path = self._make_cuda_path(model_runner)

    def _resolve_options(self, model_runner):
        """Options over the tuned profile of this device and the served attention shapes."""
        k = self.token_to_kv_pool.get_key_buffer(getattr(self.token_to_kv_pool, "start_layer", 0) or 0)
        tp_size = int(getattr(model_runner, "tp_size", 1) or 1)
        shapes = Shapes(int(k.shape[2]), int(model_runner.model_config.num_attention_heads) // tp_size,
                        int(k.shape[1]), str(k.dtype).replace("torch.", ""))
        target = "cpu" if k.device.type == "cpu" else "cuda"
        config, serving, selection = resolve_options(target, shapes)
        logger.info("%s", selection.message)
        self.selection = selection
        return config, serving

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

    def _make_cuda_path(self, model_runner):
        """The graph-safe Triton decode path on CUDA devices; None on CPU."""
        k = self.token_to_kv_pool.get_key_buffer(self._first_layer())
        if k.device.type != "cuda":
            return None
        from .cuda_path import CudaDecodePath, cuda_launch

        tp_size = int(getattr(model_runner, "tp_size", 1) or 1)
        heads_q = int(model_runner.model_config.num_attention_heads) // tp_size
        v = self.token_to_kv_pool.get_value_buffer(self._first_layer())
        launch = cuda_launch(self.selection.profile)
        return CudaDecodePath(self.config, launch, int(model_runner.model_config.context_len), heads_q,
                              int(k.shape[1]), int(v.shape[2]), k.device)

    # ----- CUDA graphs (CUDA path only) ----------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        if self.cuda_path is None:
            return super().init_cuda_graph_state(max_bs, max_num_tokens)
        self.cuda_path.init_graph_state(max_bs)

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        super().init_forward_metadata(forward_batch)
        self._decode_plan = None
        if self.cuda_path is None and forward_batch.forward_mode.is_decode():
            self._decode_plan = self._plan(forward_batch)
        self.init_forward_metadata_in_graph(forward_batch)

    def _plan(self, forward_batch: ForwardBatch):
        """(forward_batch, page table, seq_lens, DecodePlan) of a CPU decode forward: planned once
        per forward and shared by every layer."""
        page_table, seq_lens = self._page_table(forward_batch)
        return forward_batch, page_table, seq_lens, plan_decode(page_table, seq_lens, self.config)

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch):
        """Page table and lengths of a decode batch: static-shape device ops, recorded in the
        decode graph and replayed on the runner's input buffers."""
        if self.cuda_path is not None and forward_batch.forward_mode.is_decode():
            self.cuda_path.prepare(self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                                   forward_batch.seq_lens)

    # ----- index storage -------------------------------------------------------------------------

    def _store(self, layer_id: int) -> PageIndexStore:
        store = self.stores.get(layer_id)
        if store is None:
            k_buffer = self.token_to_kv_pool.get_key_buffer(layer_id)
            num_pages = k_buffer.shape[0] // self.page_size
            store = PageIndexStore(self.config, num_pages, k_buffer.shape[1], k_buffer.shape[2],
                                   k_buffer.dtype, k_buffer.device)
            self.stores[layer_id] = store
            self.built[layer_id] = torch.zeros(num_pages, dtype=torch.bool, device=k_buffer.device)
        return store

    def _log_memory_estimate(self) -> None:
        pool = self.token_to_kv_pool
        try:
            k = pool.get_key_buffer(0)
            probe = PageIndexStore(self.config, 1, k.shape[1], k.shape[2], k.dtype)
            per_layer = probe.bytes_per_token_head() * k.shape[1] * k.shape[0]
            kv_per_layer = 2 * k.numel() * k.element_size()
            logger.info("louver: index memory %.1f MiB (%.1f%% of the KV pool) over %d layers",
                        per_layer * pool.layer_num / 2**20, 100 * per_layer / kv_per_layer, pool.layer_num)
        except Exception as exc:  # an estimate only; never block startup on it
            logger.debug("louver: no index memory estimate (%s)", exc)

    def _build(self, layer_id: int, page_ids: torch.Tensor) -> None:
        if page_ids.numel() == 0:
            return
        page_ids = torch.unique(page_ids.long())
        self._store(layer_id).build_pages(self.token_to_kv_pool.get_key_buffer(layer_id), page_ids)
        self.built[layer_id][page_ids] = True

    def _invalidate(self, layer_id: int, slots: torch.Tensor) -> None:
        self._store(layer_id)
        self.built[layer_id][slots.long() // self.page_size] = False

    # ----- forward -------------------------------------------------------------------------------

    @staticmethod
    def _indexable(layer: RadixAttention) -> bool:
        return (not layer.is_cross_attention and layer.attn_type == AttentionType.DECODER
                and not (layer.sliding_window_size is not None and layer.sliding_window_size > -1)
                and not layer.logit_cap and layer.qk_head_dim == layer.v_head_dim)

    def forward_extend(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache=True):
        out = super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if self._indexable(layer) and save_kv_cache:
            self._invalidate(layer.layer_id, forward_batch.out_cache_loc)
            self._build(layer.layer_id, self._completed_extend_pages(forward_batch))
            if layer.layer_id == self._first_layer():
                self._count_extend(forward_batch)
                self.telemetry.dump()
        return out

    def forward_decode(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache=True):
        if not self._indexable(layer):
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        if self.cuda_path is not None:
            return self._forward_decode_cuda(q, k, v, layer, forward_batch, save_kv_cache)
        h_q, dim = layer.tp_q_head_num, layer.qk_head_dim
        q = q.reshape(-1, h_q * dim)
        out = torch.empty_like(q)
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v)
            self._invalidate(layer.layer_id, forward_batch.out_cache_loc)
            full = forward_batch.seq_lens % self.page_size == 0
            self._build(layer.layer_id, forward_batch.out_cache_loc[full].long() // self.page_size)
            if layer.layer_id == self._first_layer():
                self.telemetry.pages_built += int(full.sum())
        cached = self._decode_plan
        if cached is None or cached[0] is not forward_batch or not torch.equal(cached[2], forward_batch.seq_lens.long()):
            self._decode_plan = self._plan(forward_batch)  # a caller that skipped init_forward_metadata
        _, page_table, seq_lens, plan = self._decode_plan
        self._build_unbuilt(layer.layer_id, page_table, seq_lens)
        with cpu_threads(self.serving.num_threads if q.device.type == "cpu" else 0):
            _, stats = louver_decode(
                q.view(-1, h_q, dim), self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                self.token_to_kv_pool.get_value_buffer(layer.layer_id), page_table, seq_lens,
                self._store(layer.layer_id), layer.scaling, self.config, out=out.view(-1, h_q, dim),
                chunk_pages=self.serving.chunk_pages, plan=plan,
            )
        self.telemetry.record_step(stats)
        if layer.layer_id == self._first_layer():
            self.telemetry.end_decode_forward()
        return out

    def _forward_decode_cuda(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache):
        """Graph-safe decode: KV write, build of the pages this step completes, Triton step.

        No host reads and no per-layer bookkeeping, so the whole forward can be captured; the
        telemetry counters of the CPU path are not collected here.
        """
        h_q, dim = layer.tp_q_head_num, layer.qk_head_dim
        q3 = q.reshape(-1, h_q, dim)
        out = torch.empty((q3.shape[0], h_q, layer.v_head_dim), dtype=q.dtype, device=q.device)
        store = self._store(layer.layer_id)
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buffer = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v)
            self.cuda_path.build_completed(store, k_buffer, forward_batch.out_cache_loc, forward_batch.seq_lens)
        self.cuda_path.decode(q3, k_buffer, v_buffer, store, layer.scaling, out, q3.shape[0])
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
        for start, end in zip(forward_batch.extend_prefix_lens.tolist(), forward_batch.seq_lens.tolist()):
            self.telemetry.pages_reused += start // size
            self.telemetry.pages_built += end // size - start // size

    def _build_unbuilt(self, layer_id: int, page_table: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Build full pages that are read but not built (written outside this backend)."""
        self._store(layer_id)
        full = torch.arange(page_table.shape[1])[None, :] < (seq_lens // self.page_size)[:, None]
        needed = page_table[full]
        missing = needed[~self.built[layer_id][needed]]
        if missing.numel():
            if layer_id == self._first_layer():
                self.telemetry.pages_rebuilt_on_read += int(missing.numel())
            self._build(layer_id, missing)
