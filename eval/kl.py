"""Per-token KL divergence of a sparse policy's next-token distribution from dense attention.

Teacher forcing on a held-out text window: the context is prefilled densely once; then the
continuation tokens are fed one at a time, (a) densely and (b) with the policy in every layer's
decode step (so the policy's own outputs also shape the continuation's KV, as in serving). For
every continuation position: KL(p_dense || p_policy) in fp64 and whether the top-1 tokens agree.
"""

from __future__ import annotations

import torch

from .hf_decode import DecodeRunner, LayerKV, StepRecord, clone_cache, decode_tokens


class AttendedFraction:
    """Observer: mean fraction of the cached keys the policy attended, over (layer, step, head)."""

    def __init__(self) -> None:
        self.total, self.count = 0.0, 0

    def __call__(self, layer: int, q: torch.Tensor, kv: LayerKV, sigma: float, record: StepRecord) -> None:
        self.total += float(record.attended.double().mean(1).sum())
        self.count += record.attended.shape[0]

    @property
    def mean(self) -> float:
        return self.total / max(self.count, 1)


@torch.no_grad()
def dense_logits(model, cache, tokens: torch.Tensor, runner: DecodeRunner) -> torch.Tensor:
    """Dense logits ``[T, vocab]`` after each of ``tokens`` ``[T]``, continuing a copy of ``cache``."""
    runner.active = False
    return model(tokens[None], past_key_values=clone_cache(cache), use_cache=True).logits[0]


@torch.no_grad()
def policy_logits(model, cache, tokens: torch.Tensor, runner: DecodeRunner, capacity: int) -> torch.Tensor:
    """Logits ``[T, vocab]`` with ``runner``'s policy in every decode step (copy of ``cache``)."""
    runner.reset(capacity)
    return decode_tokens(model, clone_cache(cache), tokens, runner)


def token_kl(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(softmax(reference) || softmax(other)) per row, fp64: logits ``[T, V]`` -> ``[T]``."""
    log_p = torch.log_softmax(reference.double(), dim=-1)
    log_q = torch.log_softmax(other.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).clamp(min=0.0)


def kl_summary(reference: torch.Tensor, other: torch.Tensor) -> dict:
    """Per-token KL list, its mean/max, and top-1 agreement of two logit rows ``[T, V]``."""
    kl = token_kl(reference, other)
    agree = reference.argmax(-1) == other.argmax(-1)
    return {"kl": [float(x) for x in kl], "mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
            "top1_agreement": float(agree.double().mean()), "tokens": int(len(kl))}
