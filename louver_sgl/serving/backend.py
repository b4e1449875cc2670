"""``LouverAttnBackend``: the SGLang attention backend that runs the louver decode step.

It only delegates. Prefill/extend runs in the dense backend SGLang would pick on the device
(``serving.extend``: FlashInfer, FA3 or Triton on CUDA, ``intel_amx`` or ``torch_native`` on
CPU; ``LOUVER_EXTEND_BACKEND`` names another), which also writes K/V; louver then builds the
index of the pages that extend completed (``serving.pages``, beside the KV pool). Decode of the
indexed layers goes to one ``DecodePath`` (``serving.decode_path``): ``CpuDecodePath`` on CPU,
``CudaDecodePath`` on CUDA, whose steps SGLang's decode CUDA graphs capture (graph hooks below).
Layers the index does not serve (sliding window, cross-attention, logit cap) decode in the
extend backend, on metadata it builds once per forward.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType

from ..decode import HeadShapes
from ..memory import advise_huge_pages
from ..profiles import Shapes
from ..settings import Environment
from . import host_tier
from .decode_path import DecodePath, ServingState
from .extend import make_extend_backend
from .options import resolve_options
from .pages import ServingIndex
from .telemetry import Telemetry

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger("louver_sgl.serving")


def rank_stats_file(path: str | None, tp_rank: int) -> str | None:
    """The statistics file of a tensor-parallel rank: rank 0 writes ``path`` itself (what clients
    read), rank r > 0 ``<stem>.tp<r><suffix>`` beside it (each rank counts its own KV heads)."""
    if path is None or tp_rank == 0:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.tp{tp_rank}{p.suffix}"))


def tensor_parallel(model_runner) -> tuple[int, int]:
    """(rank, size) of this process in its tensor-parallel group: SGLang 0.5.23 keeps them in its
    runtime context (``get_parallel()``), not on the model runner; (0, 1) where no group exists
    (a model runner built outside a server, as the attention kit does)."""
    if hasattr(model_runner, "tp_size"):  # older SGLang, and stand-ins
        return int(getattr(model_runner, "tp_rank", 0) or 0), int(model_runner.tp_size or 1)
    from sglang.srt.runtime_context import get_parallel

    try:
        parallel = get_parallel()
        return int(parallel.tp_rank), int(parallel.tp_size)
    except RuntimeError:  # "parallel name 'tp_rank' has not been written in this process"
        return 0, 1


def first_layer(pool) -> int:
    """The first layer id the KV pool holds (a pipeline stage's pool starts past 0)."""
    return getattr(pool, "start_layer", 0) or 0


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
        on_cuda = self._on_cuda()
        self.extend_name, self.extend = make_extend_backend(serving.extend_backend, model_runner)
        logger.info("louver: extend (prefill) runs in SGLang's %s backend; decode in louver's %s implementation",
                    self.extend_name, serving.cuda_decode if on_cuda else "cpu")
        # the Triton kernels read token-layout codes (the CPU kernels' default is block16)
        self.index = ServingIndex(config, self.token_to_kv_pool, self.page_size, "token" if on_cuda else None)
        host_tier.track(self.token_to_kv_pool, self.index)
        self.index.log_memory_estimate()
        self.telemetry = self._make_telemetry(model_runner)
        if serving.huge_pages:
            self._pool_on_huge_pages()
        state = ServingState(self.token_to_kv_pool, self.req_to_token_pool, self.index, self.telemetry,
                             self.page_size)
        self.path: DecodePath = self._make_path(model_runner, shapes, state, on_cuda)
        self._extend_planned_for = None  # the forward the extend backend's metadata was built for
        self.telemetry.dump()  # the statistics file exists (page size, zero counts) from startup on

    def _resolve_options(self, model_runner):
        """(config, serving options, head shapes) over the tuned profile of this device and the
        served attention shapes; the config takes the server's page size."""
        first = first_layer(self.token_to_kv_pool)
        k = self.token_to_kv_pool.get_key_buffer(first)
        v = self.token_to_kv_pool.get_value_buffer(first)
        heads_q = int(model_runner.model_config.num_attention_heads) // tensor_parallel(model_runner)[1]
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

    def _make_telemetry(self, model_runner) -> Telemetry:
        server_args = getattr(model_runner, "server_args", None)
        interval = self.serving.log_interval or int(getattr(server_args, "decode_log_interval", 40) or 40)
        telemetry = Telemetry(interval, bool(getattr(server_args, "enable_metrics", False)),
                              rank_stats_file(Environment.read().stats_file, tensor_parallel(model_runner)[0]),
                              self.page_size)
        telemetry.index_allocated = self.index.allocated
        telemetry.profile = self.selection.message
        return telemetry

    def _make_path(self, model_runner, shapes: HeadShapes, state: ServingState, on_cuda: bool) -> DecodePath:
        """The CUDA path (graph-safe Triton steps) on CUDA devices, the CPU path elsewhere."""
        if not on_cuda:
            from .cpu_path import CpuDecodePath

            return CpuDecodePath(self.config, self.serving, shapes, state)
        from .cuda_path import CudaDecodePath, cuda_launch_section

        return CudaDecodePath(self.config, cuda_launch_section(self.selection.profile),
                              int(model_runner.model_config.context_len), shapes, self.device,
                              impl=self.serving.cuda_decode, state=state)

    def _on_cuda(self) -> bool:
        return self.token_to_kv_pool.get_key_buffer(self._first_layer()).device.type == "cuda"

    def _first_layer(self) -> int:
        return first_layer(self.token_to_kv_pool)

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

    # ----- metadata and CUDA graphs ---------------------------------------------------------------

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        """Eager forwards: the extend backend's metadata for extend batches; for decode batches
        the decode path's plan."""
        self._extend_planned_for = None
        if forward_batch.forward_mode.is_decode_or_idle():
            if forward_batch.forward_mode.is_decode():
                self.path.prepare(forward_batch)
            return
        self.extend.init_forward_metadata(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False):
        """The host side of a decode graph's capture or replay (the CUDA path's accounting)."""
        if self.path.graph_capturable and forward_batch.forward_mode.is_decode():
            self.path.replayed(in_capture)

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch):
        """Decode graphs: the page table and lengths of the batch, planned with static-shape
        device ops, recorded in the graph and replayed on the runner's input buffers."""
        if self.path.graph_capturable and forward_batch.forward_mode.is_decode():
            self.path.prepare(forward_batch, in_graph=True)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        if not self.path.graph_capturable:
            raise NotImplementedError("the CPU decode path is not graph-capturable")
        self.path.init_graph_state(max_bs)

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def support_triton(self):
        return self.extend.support_triton()

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
        if indexable(layer):
            return self.path.run_layer(q, k, v, layer, forward_batch, save_kv_cache)
        if self._extend_planned_for is not forward_batch:  # once per forward, at its first such layer
            self.extend.init_forward_metadata(forward_batch)
            self._extend_planned_for = forward_batch
        return self.extend.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kw)

    # ----- extend bookkeeping --------------------------------------------------------------------

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
