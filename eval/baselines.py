"""Comparison policies on the louver decode step: the same dense part, another choice of keys.

Every policy sees one request's keys ``[L, H_kv, D]`` and attends the step's dense part (sink
pages, recent pages, partial tail page; ``plan.split_pages``) plus ``k`` keys of the indexed part
per query head, ``k = round(fraction * num_indexed)``:

* ``oracle_topk``: the k indexed keys with the highest exact score (the best any top-k method
  can do; needs every exact score, so it is an upper reference, not a method).
* ``quest``: Quest-style page selection. A page's score for query q is the per-channel min/max
  bound ``sum_d max(q_d * min_d, q_d * max_d)`` over the page's keys; the ``ceil(k / P)`` best
  pages are attended whole.
* ``streaming``: StreamingLLM-style sink + window: the sink pages plus the most recent k indexed
  keys (a window extending back from the recent pages).

``masked_attention`` computes attention restricted to any attended mask in fp64.
"""

from __future__ import annotations

import math

import torch

from louver_sgl.config import LouverConfig
from louver_sgl.decode.plan import split_pages

BASELINES = ("oracle_topk", "quest", "streaming")


def dense_part_mask(num_tokens: int, heads: int, config: LouverConfig) -> tuple[torch.Tensor, range]:
    """(bool ``[H_q, L]`` mask of the dense part, range of indexed token positions)."""
    sink, indexed, recent = split_pages(num_tokens, config)
    size = config.page_size
    mask = torch.zeros((heads, num_tokens), dtype=torch.bool)
    mask[:, : sink.stop * size] = True
    mask[:, recent.start * size:] = True
    return mask, range(indexed.start * size, indexed.stop * size)


def baseline_attended(method: str, q: torch.Tensor, keys: torch.Tensor, fraction: float,
                      config: LouverConfig) -> torch.Tensor:
    """Attended mask bool ``[H_q, L]`` of ``method`` for q ``[H_q, D]`` fp32, keys ``[L, H_kv, D]``.

    ``fraction`` in [0, 1] is the share of the indexed keys each query head may attend.
    """
    if method not in BASELINES:
        raise ValueError(f"unknown baseline {method!r}; choose one of {BASELINES}")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must lie in [0, 1], got {fraction}")
    heads, length = q.shape[0], keys.shape[0]
    mask, indexed = dense_part_mask(length, heads, config)
    k = round(fraction * len(indexed))
    if k == 0 or len(indexed) == 0:
        return mask
    idx_keys = keys[indexed.start: indexed.stop]
    if method == "oracle_topk":
        top = _scores(q, idx_keys).topk(k, dim=1).indices
        mask[:, indexed.start:].scatter_(1, top, True)
    elif method == "quest":
        pages = _quest_pages(q, idx_keys, config.page_size, math.ceil(k / config.page_size))
        tokens = (pages[:, :, None] * config.page_size + torch.arange(config.page_size)).reshape(heads, -1)
        mask[:, indexed.start:].scatter_(1, tokens, True)
    else:
        mask[:, indexed.stop - k: indexed.stop] = True
    return mask


def _scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Exact fp32 scores ``[H_q, N]`` of q ``[H_q, D]`` against keys ``[N, H_kv, D]``."""
    groups = q.shape[0] // keys.shape[1]
    return torch.einsum("hd,nhd->hn", q.float(), keys.float().repeat_interleave(groups, dim=1))


def _quest_pages(q: torch.Tensor, keys: torch.Tensor, page_size: int, num_pages: int) -> torch.Tensor:
    """Indices ``[H_q, num_pages]`` of the pages with the highest per-channel min/max bound."""
    heads, h_kv = q.shape[0], keys.shape[1]
    paged = keys.float().view(-1, page_size, h_kv, keys.shape[2])
    lo = paged.amin(dim=1).repeat_interleave(heads // h_kv, dim=1)  # [pages, H_q, D]
    hi = paged.amax(dim=1).repeat_interleave(heads // h_kv, dim=1)
    bound = torch.maximum(q * lo, q * hi).sum(-1)  # [pages, H_q]
    return bound.t().topk(min(num_pages, paged.shape[0]), dim=1).indices


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attended: torch.Tensor,
                     sigma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention restricted to ``attended`` ``[H_q, L]``, in fp64.

    q ``[H_q, D]``; keys/values ``[L, H_kv, D]``. Returns (output ``[H_q, D_v]`` fp64, dropped
    softmax mass ``[H_q]`` fp64: the exact dense probability of the keys not attended).
    """
    groups = q.shape[0] // keys.shape[1]
    s = sigma * torch.einsum("hd,lhd->hl", q.double(), keys.double().repeat_interleave(groups, dim=1))
    p_dense = torch.softmax(s, dim=1)
    p = torch.softmax(s.masked_fill(~attended, -math.inf), dim=1)
    out = torch.einsum("hl,lhd->hd", p, values.double().repeat_interleave(groups, dim=1))
    return out, (p_dense * ~attended).sum(1)
