"""Segmented reductions over flat (entry, head) tables; a segment is one request."""

from __future__ import annotations

import torch

from ..index.numerics import norm_up, score_slack


def seg_amax(values: torch.Tensor, seg: torch.Tensor, num_segs: int) -> torch.Tensor:
    """Per-segment max: values ``[n, H]``, seg ``[n]`` -> ``[num_segs, H]`` (−inf if empty)."""
    out = torch.full((num_segs, values.shape[1]), float("-inf"), dtype=values.dtype, device=values.device)
    if values.numel():
        out.scatter_reduce_(0, seg[:, None].expand_as(values), values, reduce="amax", include_self=True)
    return out


def seg_sum(values: torch.Tensor, seg: torch.Tensor, num_segs: int) -> torch.Tensor:
    """Per-segment sum: values ``[n, ...]``, seg ``[n]`` -> ``[num_segs, ...]``."""
    out = torch.zeros((num_segs, *values.shape[1:]), dtype=values.dtype, device=values.device)
    if values.numel():
        out.index_add_(0, seg, values)
    return out


def exact_scores(
    q: torch.Tensor, k_cache: torch.Tensor, slots: torch.Tensor, req: torch.Tensor
) -> torch.Tensor:
    """Exact fp32 scores of whole token rows.

    q ``[B, H_q, D]`` fp32; k_cache ``[slots, H_kv, D]``; slots, req ``[n]`` -> ``[n, H_q]``.
    """
    b, h_q, dim = q.shape
    h_kv = k_cache.shape[1]
    keys = k_cache[slots].to(torch.float32)  # [n, H_kv, D]
    rows = q.view(b, h_kv, h_q // h_kv, dim)[req]  # [n, H_kv, G, D]
    return torch.einsum("nkd,nkgd->nkg", keys, rows).reshape(len(slots), h_q)


def part_slack(q: torch.Tensor, k_cache: torch.Tensor, slots: torch.Tensor, req: torch.Tensor) -> torch.Tensor:
    """Per (request, query head) the slack of every exact score of a part's rows (``slots``,
    ``req`` ``[n]``): ``numerics.score_slack`` of ‖q_h‖ and the part's largest key norm for h's
    KV head, ``[B, H_q]`` fp64 (0 where the request has no row in the part)."""
    b, h_q, dim = q.shape
    h_kv = k_cache.shape[1]
    k_norm = seg_amax(norm_up(k_cache[slots].to(torch.float32)), req, b).clamp(min=0.0)  # [B, H_kv]
    return score_slack(norm_up(q), k_norm.repeat_interleave(h_q // h_kv, dim=1), dim)
