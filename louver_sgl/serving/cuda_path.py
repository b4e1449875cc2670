"""The louver decode step inside SGLang on CUDA, with address-stable buffers for decode graphs.

SGLang captures one decode graph per batch size and replays it with new metadata. Everything
here that runs per step is a static-shape device op on buffers allocated once: the page table is
gathered from ``req_to_token`` on the device, the page a decode step completes is built by a
fixed-size Triton build (placeholder ids are skipped), and the decode kernels read the sequence
lengths on the device. Nothing reads a device value on the host, so the same calls run eagerly
and under capture.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from louver_kernels.triton.grid_build import grid_build
from louver_kernels.triton.launch import TritonLaunch

from ..config import LouverConfig
from ..decode.gpu import GpuWorkspace, louver_decode_gpu
from ..index.store import PageIndexStore


def cuda_launch(profile) -> TritonLaunch:
    """Triton launch parameters from a CUDA profile's launch section (defaults without one)."""
    if profile is None or profile.target != "cuda":
        return TritonLaunch()
    return TritonLaunch.from_dict(profile.launch)


@dataclass
class GraphBuffers:
    """Per-step device metadata for up to ``max_bs`` requests.

    page_table ``[max_bs, max_pages]`` int32; seq_lens ``[max_bs]`` int32; build_ids
    ``[max_bs]`` int64 (page completed by this step per request, −1 for none).
    """

    page_table: torch.Tensor
    seq_lens: torch.Tensor
    build_ids: torch.Tensor
    workspace: GpuWorkspace

    @property
    def max_bs(self) -> int:
        return self.seq_lens.shape[0]


class CudaDecodePath:
    """Graph-safe metadata, page builds and decode steps of the louver backend on CUDA."""

    def __init__(self, config: LouverConfig, launch: TritonLaunch, max_context: int, heads_q: int,
                 heads_kv: int, head_dim_v: int, device) -> None:
        if config.family != "grid":
            raise ValueError("the CUDA decode path runs the grid family")
        self.config, self.launch = config, launch
        self.page_size = config.page_size
        self.max_pages = math.ceil(max_context / self.page_size)
        self.heads_q, self.heads_kv, self.head_dim_v = heads_q, heads_kv, head_dim_v
        self.device = torch.device(device)
        self.buffers: GraphBuffers | None = None

    def init_graph_state(self, max_bs: int) -> GraphBuffers:
        """Allocate (once, or larger) the buffers every captured graph points into."""
        if self.buffers is None or self.buffers.max_bs < max_bs:
            dev = self.device
            self.buffers = GraphBuffers(
                page_table=torch.zeros(max_bs, self.max_pages, dtype=torch.int32, device=dev),
                seq_lens=torch.ones(max_bs, dtype=torch.int32, device=dev),
                build_ids=torch.full((max_bs,), -1, dtype=torch.int64, device=dev),
                workspace=GpuWorkspace.allocate(max_bs, self.max_pages, self.heads_q, self.heads_kv,
                                                self.head_dim_v, self.config, self.launch, dev),
            )
        return self.buffers

    def prepare(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> int:
        """Fill the page table and lengths of a decode batch (static-shape device ops).

        Args:
            req_to_token: ``[max_reqs, max_context]`` int32 slot of every position of every request.
            req_pool_indices: ``[bs]`` row of each request; seq_lens: ``[bs]`` tokens per request.
        Returns the batch size.
        """
        bs = seq_lens.shape[0]
        buf = self.init_graph_state(bs)
        size = self.page_size
        first_slots = req_to_token[req_pool_indices.long(), : self.max_pages * size : size]
        buf.page_table[:bs, : first_slots.shape[1]].copy_(torch.div(first_slots, size, rounding_mode="floor"))
        buf.seq_lens[:bs].copy_(seq_lens)
        return bs

    def build_completed(self, store: PageIndexStore, k_buffer: torch.Tensor, out_cache_loc: torch.Tensor,
                        seq_lens: torch.Tensor) -> None:
        """Build the page each request completed in this step (its last slot was just written).

        out_cache_loc ``[bs]`` slot written per request; seq_lens ``[bs]`` lengths including it.
        """
        bs = seq_lens.shape[0]
        ids = self.buffers.build_ids[:bs]
        done = torch.remainder(seq_lens, self.page_size) == 0
        page = torch.div(out_cache_loc.long(), self.page_size, rounding_mode="floor")
        torch.where(done, page, torch.full_like(page, -1), out=ids)
        if store.code_layout != "token":
            raise ValueError("the Triton page build writes token-layout codes; make the store with code_layout='token'")
        t = store.tensors
        grid_build(k_buffer, ids, t["lo"], t["scale"], t["radius"], t["codes"], self.page_size,
                   self.config.grid_bits, self.launch)

    def decode(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, store: PageIndexStore,
               sigma: float, out: torch.Tensor, bs: int) -> torch.Tensor:
        """One louver step for the prepared batch: q ``[bs, H_q, D]`` -> ``out`` ``[bs, H_q, D_v]``."""
        buf = self.buffers
        louver_decode_gpu(q, k_buffer, v_buffer, buf.page_table[:bs], buf.seq_lens[:bs], store, sigma,
                          self.config, self.launch, buf.workspace, out, with_stats=False)
        return out
