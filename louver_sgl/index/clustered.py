"""Clustered codebooks: the paper's corner of the bound family (subspace width w > 1).

Per page, KV head and subspace s (S contiguous slices of width w), the page's P keys are split into
P / bf balanced clusters by a max-variance KD split (each level sorts every cluster along its
highest-variance coordinate and halves it). Each cluster stores a center c (mean, in the KV
dtype) and a radius r = max ‖k_s − c‖ computed in fp64 from the *stored* center and rounded up;
every token stores one cluster code per subspace (< P / bf, uint8). Then
    q·k ≤ Σ_s (q_s·c_{s,code_s} + ‖q_s‖·r_{s,code_s}).
With ``residual_norms`` the token's own ‖k_s − c‖ (rounded up) replaces the cluster radius.
The page bound is Σ_s max_c (q_s·c + ‖q_s‖·r).
"""

from __future__ import annotations

import torch

from .numerics import dot_slack, norm_up, round_up


def _balanced_kd_order(points: torch.Tensor, num_clusters: int) -> torch.Tensor:
    """Permutation that groups ``points`` [B, P, w] into ``num_clusters`` runs of equal size.

    Deterministic: variances in fp32 over fixed shapes, ties broken by the stable sort.
    Returns ``order`` [B, P] int64: position j holds the token in cluster j // (P / num_clusters).
    """
    batch, size, width = points.shape
    order = torch.arange(size).expand(batch, size).clone()
    pts = points
    groups = 1
    while groups < num_clusters:
        run = size // groups
        view = pts.reshape(batch, groups, run, width)
        axis = view.var(dim=2, unbiased=False).nan_to_num(nan=0.0).argmax(dim=-1)
        coord = torch.gather(view, 3, axis[:, :, None, None].expand(batch, groups, run, 1))[..., 0]
        perm = torch.argsort(coord, dim=-1, stable=True)
        base = (torch.arange(groups) * run)[None, :, None]
        flat = (perm + base).reshape(batch, size)
        order = torch.gather(order, 1, flat)
        pts = torch.gather(pts, 1, flat[..., None].expand(batch, size, width))
        groups *= 2
    return order


def build_clustered(
    keys: torch.Tensor,
    n_subspaces: int,
    cluster_size: int,
    meta_dtype: torch.dtype,
    residual_norms: bool,
) -> dict[str, torch.Tensor]:
    """Build clustered codebooks for a batch of full pages.

    Args:
        keys: ``[n_pages, P, H_kv, D]`` stored keys.
        n_subspaces: S (D % S == 0); cluster_size: bf (P % bf == 0, P / bf a power of two).
        meta_dtype: storage dtype of centers and residual norms (the KV dtype).

    Returns ``centers`` ``[n, H_kv, S, C, w]`` (meta_dtype), ``radius`` ``[n, H_kv, S, C]`` fp32,
    ``codes`` ``[n, P, H_kv, S]`` uint8, and with ``residual_norms`` also ``residual``
    ``[n, P, H_kv, S]`` (meta_dtype), C = P / bf.
    """
    n, size, heads, dim = keys.shape
    width, clusters = dim // n_subspaces, size // cluster_size
    x = keys.to(torch.float32).reshape(n, size, heads, n_subspaces, width)
    pts = x.permute(0, 2, 3, 1, 4).reshape(-1, size, width)  # [n*H*S, P, w]
    order = _balanced_kd_order(pts, clusters)
    cluster_of_pos = torch.arange(size) // cluster_size
    codes = torch.empty_like(order)
    codes.scatter_(1, order, cluster_of_pos.expand_as(order).contiguous())
    members = torch.gather(pts, 1, order[..., None].expand(-1, -1, width))
    members = members.reshape(-1, clusters, cluster_size, width)
    centers = members.mean(dim=2).to(meta_dtype)  # [n*H*S, C, w]
    own_center = torch.gather(
        centers.to(torch.float64), 1, codes[..., None].expand(-1, -1, width)
    )
    dist = (pts.to(torch.float64) - own_center).norm(dim=-1)  # [n*H*S, P]
    radius = torch.full((pts.shape[0], clusters), float("-inf"), dtype=torch.float64)
    radius = radius.scatter_reduce(1, codes, dist, reduce="amax", include_self=True)
    radius = torch.where(dist.isnan().any(dim=1, keepdim=True), float("nan"), radius)
    out = {
        "centers": centers.reshape(n, heads, n_subspaces, clusters, width),
        "radius": round_up(radius, torch.float32).reshape(n, heads, n_subspaces, clusters),
        "codes": codes.reshape(n, heads, n_subspaces, size).permute(0, 3, 1, 2).to(torch.uint8),
    }
    if residual_norms:
        res = round_up(dist, meta_dtype).reshape(n, heads, n_subspaces, size)
        out["residual"] = res.permute(0, 3, 1, 2).contiguous()
    return out


def clustered_cluster_scores(
    q: torch.Tensor, centers: torch.Tensor, radius: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-cluster scores of a batch of pages.

    Args:
        q: ``[n, H_kv, G, D]`` fp32 queries; centers ``[n, H_kv, S, C, w]``; radius ``[n, H_kv, S, C]``.

    Returns ``(center_dot [n, H_kv, G, S, C], q_norm [n, H_kv, G, S], page_bound [n, H_kv, G],
    slack [n, H_kv, G])`` fp32; page_bound includes the slack.
    """
    n, heads, groups, dim = q.shape
    n_sub, width = centers.shape[2], centers.shape[4]
    qs = q.reshape(n, heads, groups, n_sub, width)
    c32 = centers.to(torch.float32)
    center_dot = torch.einsum("nkgsw,nkscw->nkgsc", qs, c32)
    q_norm = norm_up(qs)
    ball = q_norm.unsqueeze(-1) * radius.unsqueeze(2)
    magnitude = torch.einsum("nkgsw,nkscw->nkgsc", qs.abs(), c32.abs()) + ball
    slack = dot_slack(magnitude.amax(dim=-1).sum(-1), dim + 2 * n_sub)
    page_bound = (center_dot + ball).amax(dim=-1).sum(-1) + slack
    return center_dot, q_norm, page_bound, slack


def clustered_token_bounds(
    codes: torch.Tensor,
    center_dot: torch.Tensor,
    q_norm: torch.Tensor,
    radius: torch.Tensor,
    slack: torch.Tensor,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token upper bounds ``[n, P, H_kv, G]`` fp32 from codes ``[n, P, H_kv, S]`` uint8.

    ``residual`` ``[n, P, H_kv, S]`` replaces the cluster radius by the token's own residual norm.
    """
    n, size, heads, n_sub = codes.shape
    groups = center_dot.shape[2]
    idx = codes.long().permute(0, 2, 3, 1)  # [n, H, S, P]
    idx_g = idx.unsqueeze(2).expand(n, heads, groups, n_sub, size)
    dots = torch.gather(center_dot, 4, idx_g)  # [n, H, G, S, P]
    if residual is None:
        rad = torch.gather(radius, 3, idx).unsqueeze(2)  # [n, H, 1, S, P]
    else:
        rad = residual.to(torch.float32).permute(0, 2, 3, 1).unsqueeze(2)
    bound = (dots + q_norm.unsqueeze(-1) * rad).sum(3) + slack.unsqueeze(-1)
    return bound.permute(0, 3, 1, 2)
