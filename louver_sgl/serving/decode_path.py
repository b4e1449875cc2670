"""What the serving backend asks of a decode strategy, and what the strategies share.

The backend only delegates: extend goes to SGLang's dense backend, decode to one ``DecodePath``:
``CpuDecodePath`` (``cpu_path``: host planning, the compiled CPU step, host-side telemetry) or
``CudaDecodePath`` (``cuda_path``: static-shape device ops that SGLang's decode CUDA graphs
capture, telemetry summed on the device). A path

- ``prepare``\\ s a decode forward once (its ``DecodeForward``: lengths and page table),
- ``run_layer``\\ s: writes the token's K/V, builds the pages it completes, runs the step,
- ``report``\\ s: its counts into the ``Telemetry`` (log window, statistics file, Prometheus).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .pages import ServingIndex
from .telemetry import Telemetry

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


@dataclass(frozen=True)
class DecodeForward:
    """One decode forward as planned, built once per forward.

    batch: the SGLang batch it was planned for (the same object every layer sees);
    seq_lens: ``[B]`` int64 tokens per request, the decode token included;
    page_table: ``[B, max_pages]`` int64 page ids (None where the plan lives on the device).
    """

    batch: ForwardBatch
    seq_lens: torch.Tensor
    page_table: torch.Tensor | None = None


@dataclass
class ServingState:
    """What the decode paths share with the backend: SGLang's pools, louver's index and counters."""

    token_to_kv_pool: object
    req_to_token_pool: object
    index: ServingIndex
    telemetry: Telemetry
    page_size: int

    @property
    def first_layer(self) -> int:
        return self.index.first_layer

    def key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.token_to_kv_pool.get_key_buffer(layer_id)

    def value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.token_to_kv_pool.get_value_buffer(layer_id)


class DecodePath(abc.ABC):
    """A decode strategy of the backend (see the module docstring)."""

    graph_capturable = False

    @abc.abstractmethod
    def prepare(self, forward_batch: ForwardBatch, in_graph: bool = False) -> DecodeForward:
        """Plan a decode forward (``in_graph``: inside a CUDA-graph capture, on its buffers)."""

    @abc.abstractmethod
    def run_layer(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                  layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache: bool) -> torch.Tensor:
        """One indexed layer's decode: q ``[B, H_q·D]`` (or ``[B, H_q, D]``), the token's k/v
        ``[B, H_kv, D]`` -> ``[B, H_q·D_v]`` in q's dtype."""

    def replayed(self, in_capture: bool) -> None:
        """The host side of a decode graph's capture or replay (graph-capturable paths only)."""
        raise NotImplementedError(f"{type(self).__name__} is not graph-capturable")

    def init_graph_state(self, max_bs: int) -> None:
        """Buffers for decode graphs of batches up to ``max_bs`` (graph-capturable paths only)."""
        raise NotImplementedError(f"{type(self).__name__} is not graph-capturable")

    @abc.abstractmethod
    def report(self) -> None:
        """End of a decode forward's accounting: counts into the telemetry, the window logged
        every ``interval`` forwards, the statistics file written."""
