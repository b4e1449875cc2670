"""Run SmolLM2 with Hugging Face transformers and a sparse decode policy in every decode step.

A registered attention function (``louver_eval``) runs dense sdpa for prefill chunks. For a
one-token decode step it hands the post-RoPE query and the layer's whole KV cache to a
``DecodeRunner``, which keeps a paged copy of each layer's KV (identity page table, the cache's
dtype or a chosen KV dtype) with its page index built as pages fill, runs the policy and returns
its attention output to the model. An optional observer sees every (layer, step) with the policy's
attended set: the exactness evaluation checks it there against an fp64 brute force.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch

from louver_sgl.config import LouverConfig
from louver_sgl.decode import LouverDecode, StepStats
from .baselines import baseline_attended, masked_attention
from louver_sgl.index.store import PageIndexStore

ATTN_NAME = "louver_eval"
PREFILL_CHUNK = 1024


class LayerKV:
    """Paged copy of one layer's KV cache (page i holds positions i*P..i*P+P−1) and its index.

    k, v: ``[capacity, H_kv, D]`` in ``dtype``; ``length`` tokens are valid; pages below
    ``length // P`` are built in ``store``.
    """

    def __init__(self, config: LouverConfig, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 capacity: int) -> None:
        pages = math.ceil(capacity / config.page_size)
        self.k = torch.zeros((pages * config.page_size, num_kv_heads, head_dim), dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.store = PageIndexStore(config, pages, num_kv_heads, head_dim, dtype)
        self.length = 0
        self._built = 0

    def sync(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Take over the model's cache ``key``/``value`` ``[1, H_kv, L, D]``: copy new positions
        and build the pages that became full."""
        n = key.shape[2]
        if n > self.k.shape[0]:
            raise ValueError(f"{n} tokens exceed the evaluation cache capacity {self.k.shape[0]}")
        self.k[self.length:n] = key[0, :, self.length:].transpose(0, 1)
        self.v[self.length:n] = value[0, :, self.length:].transpose(0, 1)
        self.length = n
        full = n // self.store.page_size
        if full > self._built:
            self.store.build_pages(self.k, torch.arange(self._built, full))
            self._built = full

    def keys(self) -> torch.Tensor:
        return self.k[: self.length]

    def values(self) -> torch.Tensor:
        return self.v[: self.length]


@dataclass
class StepRecord:
    """What a policy did in one (layer, step): attended bool ``[H_q, L]``; louver stats or None."""

    attended: torch.Tensor
    stats: StepStats | None


class DecodePolicy(Protocol):
    config: LouverConfig

    def decode(self, q: torch.Tensor, kv: LayerKV, sigma: float) -> tuple[torch.Tensor, StepRecord]:
        """q ``[H_q, D]`` fp32 -> (attention output ``[H_q, D]`` fp32, record)."""


class LouverPolicy:
    """The louver step (the ``torch`` implementation, which returns the attended set) with
    ``config``'s policy."""

    def __init__(self, config: LouverConfig) -> None:
        self.config = config

    def decode(self, q, kv: LayerKV, sigma):
        table = torch.arange(kv.store.num_pages)[None]
        decode = LouverDecode(self.config, impl="torch").plan(table, torch.tensor([kv.length]))
        step_result = decode.run(q[None], kv.k, kv.v, kv.store, sigma, attended=True)
        out, stats, attended = step_result.out, step_result.stats, step_result.attended
        return out[0].float(), StepRecord(attended[0], stats)


class BaselinePolicy:
    """A comparison policy of ``louver_eval.baselines`` at a fixed share of the indexed keys."""

    def __init__(self, method: str, fraction: float, config: LouverConfig) -> None:
        self.method, self.fraction, self.config = method, fraction, config

    def decode(self, q, kv: LayerKV, sigma):
        keys, values = kv.keys(), kv.values()
        attended = baseline_attended(self.method, q, keys, self.fraction, self.config)
        out, _ = masked_attention(q, keys, values, attended, sigma)
        return out.float(), StepRecord(attended, None)


Observer = Callable[[int, torch.Tensor, LayerKV, float, StepRecord], None]


class DecodeRunner:
    """Per-layer paged KV copies, the policy, and the observer of one generation."""

    def __init__(self, policy: DecodePolicy, kv_dtype: torch.dtype | None = None,
                 observer: Observer | None = None) -> None:
        self.policy, self.kv_dtype, self.observer = policy, kv_dtype, observer
        self.layers: dict[int, LayerKV] = {}
        self.active = False
        self.capacity = 0

    def reset(self, capacity: int) -> None:
        """Forget all KV copies; the next generation holds at most ``capacity`` tokens."""
        self.layers, self.capacity = {}, capacity

    def decode(self, layer: int, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               sigma: float) -> torch.Tensor:
        """q ``[H_q, D]``; key/value ``[1, H_kv, L, D]`` (the model's cache) -> ``[H_q, D]``."""
        kv = self.layers.get(layer)
        if kv is None:
            dtype = self.kv_dtype or key.dtype
            kv = self.layers[layer] = LayerKV(self.policy.config, key.shape[1], key.shape[3], dtype,
                                              self.capacity)
        kv.sync(key, value)
        out, record = self.policy.decode(q.float(), kv, sigma)
        if self.observer is not None:
            self.observer(layer, q.float(), kv, sigma, record)
        return out.to(q.dtype)


def eval_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """sdpa, except one-token decode steps go to ``module.louver_runner`` while it is active.

    query ``[1, H_q, q_len, D]``, key/value ``[1, H_kv, L, D]``; returns ``([1, q_len, H_q, D], None)``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    runner = getattr(module, "louver_runner", None)
    if runner is None or not runner.active or query.shape[0] != 1 or query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    out = runner.decode(module.layer_idx, query[0, :, 0], key, value, scaling)
    return out[None, None], None


def load_eval_model(model_dir: str | Path, runner: DecodeRunner):
    """SmolLM2 in fp32 with ``eval_attention`` wired to ``runner``; returns (model, tokenizer)."""
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN_NAME, eval_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation=ATTN_NAME).eval()
    attach_runner(model, runner)
    return model, AutoTokenizer.from_pretrained(model_dir)


def attach_runner(model, runner: DecodeRunner) -> None:
    """Point every attention layer of ``model`` at ``runner``."""
    for layer in model.model.layers:
        layer.self_attn.louver_runner = runner


@torch.no_grad()
def prefill(model, ids: torch.Tensor, runner: DecodeRunner):
    """Dense forward of ``ids`` ``[L]`` in chunks; returns (cache, logits of the last position)."""
    from transformers import DynamicCache

    runner.active = False
    cache = DynamicCache(config=model.config)
    logits = None
    for start in range(0, len(ids), PREFILL_CHUNK):
        logits = model(ids[None, start:start + PREFILL_CHUNK], past_key_values=cache, use_cache=True).logits
    return cache, logits[0, -1]


@torch.no_grad()
def decode_tokens(model, cache, tokens: torch.Tensor, runner: DecodeRunner) -> torch.Tensor:
    """Feed ``tokens`` ``[T]`` one at a time through the policy's decode steps (teacher forcing).

    Returns logits ``[T, vocab]`` fp32: row i predicts the token after ``tokens[i]``.
    """
    runner.active = True
    try:
        rows = [model(t.view(1, 1), past_key_values=cache, use_cache=True).logits[0, -1] for t in tokens]
    finally:
        runner.active = False
    return torch.stack(rows)


@torch.no_grad()
def greedy_generate(model, ids: torch.Tensor, runner: DecodeRunner, max_new_tokens: int,
                    on_token: Callable[[int], None] | None = None) -> list[int]:
    """Greedy generation after ``ids`` ``[L]`` with the policy in every decode step."""
    runner.reset(len(ids) + max_new_tokens)
    cache, logits = prefill(model, ids, runner)
    out = []
    runner.active = True
    try:
        for _ in range(max_new_tokens):
            token = int(logits.argmax())
            out.append(token)
            if on_token is not None:
                on_token(token)
            logits = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1]
    finally:
        runner.active = False
    return out


def clone_cache(cache):
    """An independent copy of a ``DynamicCache`` (one prefill shared by several policies)."""
    return copy.deepcopy(cache)
