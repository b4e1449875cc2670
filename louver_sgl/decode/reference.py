"""Plain-torch reference of the Louver decode step: the specification the fast path must match.

One request and one query head at a time, with every rule written out directly:
  1. Dense part D = sink pages ∪ recent pages ∪ tail; indexed part = the other full pages.
  2. Exact scores s_i = q·k_i; ref m = max over D ∪ sample; Z_lb = Σ_{D ∪ sample} e^{σ(s − δ − m)},
     δ the fp32 slack of the score (``numerics.score_slack``; D and the sample each take ‖q‖ times
     their largest key norm, candidates their own), so Z_lb bounds the true keys' mass.
  3. Threshold T by policy (certified: the largest edge whose dropped mass fits, pages first; with
     ``certified_passes=1`` the provisional level where every head's dropped mass fits there;
     with ``certified_rule="a_posteriori"`` the level that fits an estimate of Z, lowered where
     its mass does not fit the exact mass Z_att of what the step attends there; with both, the
     safe level at the estimate, lowered to the safe level at Z_att where its mass does not fit).
  4. Candidates of head h: indexed keys with page bound ≥ T_h and token bound ≥ T_h; the attended
     set of every head of a GQA group is the union of the group's candidates, minus (value gate)
     candidates whose exact score is below the head's T (budget and fixed policies only).
  5. Softmax over D ∪ attended candidates in fp64; dense fallback above the candidate fraction.
"""

from __future__ import annotations

import math

import torch

from ..config import LouverConfig
from ..index.numerics import norm_up, score_slack
from ..index.store import PageIndexStore
from . import threshold as th
from .plan import _sample_positions, split_pages


def reference_decode(q, k_cache, v_cache, page_table, seq_lens, store: PageIndexStore, sigma, config=None):
    """Same contract as ``louver_decode``; returns ``(out [B, H_q, D_v] fp32, info)`` where info
    is a list (per request) of dicts with ``threshold``, ``attended`` (bool ``[H_q, L]``),
    ``mass_bound`` ``[H_q]`` and ``dense_fallback``."""
    config = config or store.config
    outs, infos = [], []
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        pos = torch.arange(n)
        slots = page_table[b].long()[pos // config.page_size] * config.page_size + pos % config.page_size
        o, info = _one_request(q[b].float(), k_cache[slots], v_cache[slots], page_table[b], n, store, sigma, config)
        outs.append(o)
        infos.append(info)
    return torch.stack(outs), infos


def _one_request(q, keys, values, pages_row, n, store, sigma, cfg: LouverConfig):
    size, h_q, h_kv = cfg.page_size, q.shape[0], keys.shape[1]
    groups = h_q // h_kv
    sink, indexed, recent = split_pages(n, cfg)
    dense = torch.zeros(n, dtype=torch.bool)
    for r in (sink, recent):
        dense[r.start * size: r.stop * size] = True
    dense[n - n % size:] = True
    idx_pos = torch.arange(indexed.start * size, indexed.stop * size)
    sample = idx_pos[_sample_positions(len(idx_pos), cfg.sample_size)]
    k_rep = keys.float().repeat_interleave(groups, dim=1)  # [L, H_q, D]
    scores = torch.einsum("hd,lhd->hl", q, k_rep)  # exact fp32 scores [H_q, L]
    known = dense.clone()
    known[sample] = True
    ref = torch.where(known, scores, float("-inf")).amax(dim=1)
    x_all = th.log_mass(scores, ref[:, None], sigma)
    # masses in lower bounds take every score lowered by its fp32 slack (numerics.score_slack):
    # the dense part and the sample by ‖q‖ times their largest key norm, candidates by their own
    k_norm = norm_up(keys.float()).repeat_interleave(groups, dim=1).T  # [H_q, L]
    slack = score_slack(norm_up(q)[:, None], k_norm, q.shape[1])
    part = lambda rows: score_slack(norm_up(q), k_norm[:, rows].amax(1) if rows.any() else torch.zeros(h_q), q.shape[1])
    is_sample = torch.zeros(n, dtype=torch.bool)
    is_sample[sample] = True
    x_low = x_all - sigma * slack
    z_dense = torch.where(dense, torch.exp(x_all - sigma * part(dense)[:, None]), 0.0).sum(1)
    z_lb = z_dense + torch.where(is_sample, torch.exp(x_all - sigma * part(is_sample)[:, None]), 0.0).sum(1)
    pb, tb = _request_bounds(q, pages_row[indexed.start:indexed.stop].long(), store, h_q)
    if cfg.threshold.band_pass and len(idx_pos):
        t, keep, dropped = _a_posteriori(pb, tb, x_low[:, idx_pos], ref, z_dense, z_lb, len(sample), sigma, cfg,
                                         groups)
    elif cfg.threshold.one_pass_a_posteriori and len(idx_pos):
        t, keep, dropped = _one_pass_a_posteriori(pb, tb, x_low[:, idx_pos], ref, z_dense, z_lb, len(sample),
                                                  sigma, cfg, groups)
    else:
        t, keep, dropped = _threshold_and_keep(pb, tb, scores[:, idx_pos], ref, z_lb, sigma, cfg)
    union = keep.view(h_kv, groups, -1).any(1).repeat_interleave(groups, dim=0)  # [H_q, n_idx]
    frac = union[::groups].float().mean() if union.numel() else torch.tensor(0.0)
    if union.numel() and frac > cfg.dense_fallback_fraction:
        att = torch.ones((h_q, n), dtype=torch.bool)
        info = {"threshold": t, "attended": att, "mass_bound": torch.zeros(h_q, dtype=torch.float64), "dense_fallback": True}
        return _softmax_out(scores, values, att, sigma, groups), info
    s_idx = scores[:, idx_pos]
    z_final = torch.maximum(z_lb, z_dense + torch.where(union, torch.exp(x_low[:, idx_pos]), 0.0).sum(1))
    below = union & (s_idx < th.gate_threshold(t)[:, None])
    gated = torch.where(below, torch.exp((x_all + sigma * slack)[:, idx_pos]), 0.0).sum(1)  # an upper bound
    allowed = torch.full((h_q,), cfg.threshold.gates_values)
    att = dense.expand(h_q, n).clone()
    att[:, idx_pos] = union & ~(below & allowed[:, None])
    bound = (dropped + gated * allowed) / z_final
    info = {"threshold": t, "attended": att, "mass_bound": bound, "dense_fallback": False}
    return _softmax_out(scores, values, att, sigma, groups), info


def _request_bounds(q, page_ids, store, h_q):
    """Page bounds ``[H_q, n_pages]`` and token bounds ``[H_q, n_pages * P]`` of one request."""
    if len(page_ids) == 0:
        return torch.zeros(h_q, 0), torch.zeros(h_q, 0)
    rows = q.view(1, store.num_kv_heads, -1, q.shape[-1]).expand(len(page_ids), -1, -1, -1).contiguous()
    bounds = store.page_bounds(rows, page_ids)
    tok = store.token_bounds(bounds, page_ids)
    return bounds.page_bound.reshape(len(page_ids), h_q).t(), tok.reshape(-1, h_q).t()


def _threshold_and_keep(pb, tb, s_idx, ref, z_lb, sigma, cfg: LouverConfig):
    """Per-head T, candidate mask ``[H_q, n_idx]`` and dropped index mass ``[H_q]`` (fp64)."""
    h_q, size = pb.shape[0], cfg.page_size
    pb_tok = pb.repeat_interleave(size, dim=1)
    u = torch.minimum(tb, pb_tok)
    x_page, x_tok = th.log_mass(pb, ref[:, None], sigma), th.log_mass(u, ref[:, None], sigma)
    policy = cfg.threshold
    if policy.static_threshold is not None:  # dense (−inf) and fixed
        t = torch.full((h_q,), policy.static_threshold)
    elif policy.budget_rule:
        t = _budget(s_idx, cfg)
    else:
        one_pass = _one_pass(pb, u, x_page, x_tok, ref, z_lb, sigma, cfg) if policy.one_pass else None
        return one_pass if one_pass is not None else _certified(pb, u, x_page, x_tok, ref, z_lb, sigma, cfg)
    keep_page = ~(pb < t[:, None])
    keep = keep_page.repeat_interleave(size, dim=1) & ~(u < t[:, None])
    dropped = _mass(x_page, ~keep_page) * size + _mass(x_tok, keep_page.repeat_interleave(size, 1) & ~keep)
    return t, keep, dropped


def _one_pass(pb, u, x_page, x_tok, ref, z_lb, sigma, cfg: LouverConfig):
    """The one-pass certified rule: T = the provisional level of every head, kept if every head's
    dropped mass (times 1 + rounding: the certificate) fits eps·Z_lb; None if one does not (the
    request then takes the histogram rule)."""
    eps_budget = cfg.eps * th.BUDGET_SAFETY
    t = th.safe_level(ref[None], z_lb[None], torch.tensor([u.shape[1]]), sigma, eps_budget, th.HIST_ROUNDING)[0]
    keep, dropped = _gate(pb, u, x_page, x_tok, t, cfg.page_size)
    ok, certificate = th.provisional_certified(dropped, z_lb, eps_budget, th.HIST_ROUNDING)
    return (t, keep, certificate) if bool(ok.all()) else None


def _gate(pb, u, x_page, x_tok, t, size: int):
    """One request's candidate mask ``[H_q, n_idx]`` at T ``[H_q]`` (page bound and token bound
    reach T) and the dropped mass ``[H_q]`` fp64 (pages below T whole, other tokens below T)."""
    keep_page = ~(pb < t[:, None])
    keep = keep_page.repeat_interleave(size, dim=1) & ~(u < t[:, None])
    dropped = _mass(x_page, ~keep_page) * size + _mass(x_tok, keep_page.repeat_interleave(size, 1) & ~keep)
    return keep, dropped


def _one_pass_a_posteriori(pb, tb, x_idx, ref, z_dense, z_lb, n_sample, sigma, cfg: LouverConfig, groups):
    """The one-pass rule a posteriori: gate at the safe level at Z_est (the a-posteriori rule's
    estimate of Z); Z_att = max(Z_lb, Z_dense + the exact mass of the GQA union of candidates
    there); a head whose dropped mass does not fit eps·Z_att is lowered to the safe level at Z_att
    (``threshold.lowered_to_safe``). Returns T, the candidate mask ``[H_q, n_idx]`` and the
    certificate."""
    size, n_idx = cfg.page_size, tb.shape[1]
    eps_budget = cfg.eps * th.BUDGET_SAFETY
    u = torch.minimum(tb, pb.repeat_interleave(size, dim=1))
    x_page, x_tok = th.log_mass(pb, ref[:, None], sigma), th.log_mass(u, ref[:, None], sigma)
    n = torch.tensor([n_idx])
    z_est = th.estimated_z(z_dense[None], (z_lb - z_dense)[None], n, torch.tensor([n_sample]), cfg.estimate_share)[0]
    t0 = th.safe_level(ref[None], z_est[None], n, sigma, eps_budget, th.HIST_ROUNDING)[0]
    keep0, dropped0 = _gate(pb, u, x_page, x_tok, t0, size)
    z_att = _attended_z(keep0, x_idx, z_dense, z_lb, groups)
    t, certificate, _ = th.lowered_to_safe(t0[None], dropped0[None], z_att[None], ref[None], n, sigma, eps_budget,
                                           th.HIST_ROUNDING)
    return t[0], _gate(pb, u, x_page, x_tok, t[0], size)[0], certificate[0]


def _budget(s_idx, cfg: LouverConfig):
    n_idx = s_idx.shape[1]
    if n_idx == 0:
        return torch.full((s_idx.shape[0],), -math.inf)
    sample = s_idx[:, _sample_positions(n_idx, cfg.sample_size)]
    k = max(1, math.floor(sample.shape[1] * cfg.budget))
    return sample.sort(dim=1, descending=True).values[:, min(k, sample.shape[1]) - 1]


def _certified(pb, u, x_page, x_tok, ref, z_lb, sigma, cfg: LouverConfig):
    """One T per head: the largest edge e whose certified dropped mass fits in eps·Z_lb. The mass
    at e counts pages with x_page < e whole and tokens with x_tok < e in the other pages; its
    certificate adds the bound on the fp64 rounding of that sum (``HIST_ROUNDING`` times its
    terms, all positive here) and is the index-dropped mass reported (no recount)."""
    size = cfg.page_size
    budget = cfg.eps * z_lb * th.BUDGET_SAFETY
    t_out = torch.empty(pb.shape[0])
    keep = torch.zeros(u.shape, dtype=torch.bool)
    dropped = torch.zeros(pb.shape[0], dtype=torch.float64)
    for h in range(pb.shape[0]):
        bound_at = lambda e, h=h: _bound_at(x_page[h], x_tok[h], size, e)
        edge = _largest_edge(bound_at, budget[h])
        t_out[h], keep[h] = _keep_at(pb[h], u[h], ref[h], edge, sigma, size)
        dropped[h] = bound_at(float(th.EDGE_VALUES[edge])) if edge >= 0 else 0.0
    return t_out, keep, dropped


def _bound_at(x_page, x_tok, size: int, e: float):
    """One head's certified dropped mass at edge value e: pages with x_page < e whole, tokens with
    x_tok < e in the other pages, times 1 + ``HIST_ROUNDING`` (the bound on its fp64 rounding)."""
    page_below = x_page < e
    tok_below = ~page_below.repeat_interleave(size) & (x_tok < e)
    return (size * _mass(x_page, page_below) + _mass(x_tok, tok_below)) * (1.0 + th.HIST_ROUNDING)


def _keep_at(pb, u, ref, edge: int, sigma, size: int):
    """One head's (T, candidate mask over its indexed tokens) at edge index ``edge``."""
    t = th.edge_threshold(torch.tensor(edge), ref, sigma)
    return t, (~(pb < t)).repeat_interleave(size) & ~(u < t)


def _a_posteriori(pb, tb, x_idx, ref, z_dense, z_lb, n_sample, sigma, cfg: LouverConfig, groups):
    """The a-posteriori certified rule, one head at a time: T0 = the largest edge whose dropped
    mass fits eps·Z_est (Z_est: ``estimate_share``·(the dense part + the sample scaled to the
    indexed tokens), at least Z_lb); Z_att = the exact mass of the dense part and of the GQA
    union of candidates at T0 (at least Z_lb); a head whose mass at T0 does not fit eps·Z_att
    takes the largest edge that does. Returns T, the candidate mask ``[H_q, n_idx]`` (every
    head's keys at its final T) and the certificate (the bound at the final edge)."""
    size, h_q = cfg.page_size, pb.shape[0]
    eps_budget = cfg.eps * th.BUDGET_SAFETY
    pb_tok = pb.repeat_interleave(size, dim=1)
    u = torch.minimum(tb, pb_tok)
    x_page, x_tok = th.log_mass(pb, ref[:, None], sigma), th.log_mass(u, ref[:, None], sigma)
    n_idx = u.shape[1]

    bound_at = lambda h, e: _bound_at(x_page[h], x_tok[h], size, e)
    keep_at = lambda h, edge: _keep_at(pb[h], u[h], ref[h], edge, sigma, size)

    z_sample = z_lb - z_dense
    z_est = torch.maximum(z_lb, cfg.estimate_share * (z_dense + z_sample * n_idx / max(n_sample, 1)))
    first = [_largest_edge(lambda e, h=h: bound_at(h, e), eps_budget * z_est[h]) for h in range(h_q)]
    keep0 = torch.stack([keep_at(h, first[h])[1] for h in range(h_q)])
    z_att = _attended_z(keep0, x_idx, z_dense, z_lb, groups)
    t_out, keep = torch.empty(h_q), torch.zeros(u.shape, dtype=torch.bool)
    dropped = torch.zeros(h_q, dtype=torch.float64)
    for h in range(h_q):
        edge = first[h]
        if edge >= 0 and not bound_at(h, float(th.EDGE_VALUES[edge])) <= eps_budget * z_att[h]:
            edge = _largest_edge(lambda e, h=h: bound_at(h, e), eps_budget * z_att[h])
        t_out[h], keep[h] = keep_at(h, edge)
        dropped[h] = bound_at(h, float(th.EDGE_VALUES[edge])) if edge >= 0 else 0.0
    return t_out, keep, dropped


def _attended_z(keep, x_idx, z_dense, z_lb, groups):
    """Z_att ``[H_q]``: max(Z_lb, Z_dense + the exact mass of the GQA union of the candidate mask
    ``keep`` ``[H_q, n_idx]``, from the lowered log-masses ``x_idx``)."""
    union = keep.view(-1, groups, keep.shape[1]).any(1).repeat_interleave(groups, dim=0)
    return torch.maximum(z_lb, z_dense + _mass(x_idx, union))


def _largest_edge(mass_fn, budget) -> int:
    for j in range(th.EDGE_COUNT - 1, -1, -1):
        if mass_fn(float(th.EDGE_VALUES[j])) <= budget:
            return j
    return -1


def _mass(x, mask):
    return torch.where(mask, torch.exp(x.clamp(max=700.0)).nan_to_num(nan=0.0), 0.0).sum(-1)


def _softmax_out(scores, values, attended, sigma, groups):
    s = torch.where(attended, sigma * scores.double(), float("-inf"))
    p = torch.softmax(s, dim=1)
    v = values.double().repeat_interleave(groups, dim=1)  # [L, H_q, D_v]
    return torch.einsum("hl,lhd->hd", p, v).float()
