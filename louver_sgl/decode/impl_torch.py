"""The ``torch`` decode implementation: the batched Louver step in vectorised torch (CPU tensors,
both bound families).

Order of work (design §6): exact scores of the dense part (sink pages, recent pages, tail) and of
the sample; page bounds; thresholds; token bounds of surviving pages; union of each GQA group's
candidates; exact scores of the candidates (keys first); values only for candidates that stay
attended; one numerically stable softmax over dense part + candidates per (request, head).
Requests whose candidate fraction exceeds ``dense_fallback_fraction`` run dense attention.
``reference.py`` is the specification this must match.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..config import LouverConfig
from ..index.numerics import norm_up, score_slack
from ..index.store import PageIndexStore
from . import threshold as th
from .contract import (
    DecodeImplementation, DecodePlan, DecodeResult, ExactPart, StepStats, check_inputs, check_share_values,
)
from .filter import (FilterResult, a_posteriori_filter, a_posteriori_second, one_pass_a_posteriori_check,
                     provisional_filter, run_filter)
from .plan import plan_decode
from .segments import exact_scores, part_slack, seg_amax, seg_sum


class TorchDecode(DecodeImplementation):
    """Vectorised torch on CPU tensors; every option, both bound families; it can return the
    attended key set (evaluations, audits)."""

    name = "torch"
    returns_attended = True
    takes_shares = True

    @classmethod
    def unavailable(cls, device: torch.device) -> str | None:
        return None if device.type == "cpu" else "it runs on CPU tensors"

    def plan(self, page_table: torch.Tensor, seq_lens: torch.Tensor) -> DecodePlan:
        return plan_decode(page_table, seq_lens, self.config)

    def run(self, plan: DecodePlan, *, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            store: PageIndexStore, sigma: float, out: torch.Tensor | None = None, stats: bool = False,
            attended: bool = False, estimate_share: torch.Tensor | None = None) -> DecodeResult:
        check_inputs(q, k_cache, v_cache, store, self.config)
        if plan.batch_size != q.shape[0]:
            raise ValueError(f"the plan is for {plan.batch_size} requests, q has {q.shape[0]}")
        if estimate_share is not None:
            check_share_values(estimate_share)
        step = run_decode(q, k_cache, v_cache, plan, store, sigma, self.config, out, keep_parts=attended,
                          share=estimate_share)
        masks = attended_masks(*step[2], plan, q.shape[1], k_cache.shape[0]) if attended else None
        return DecodeResult(step[0], step[1], masks)


def run_decode(q, k_cache, v_cache, plan: DecodePlan, store, sigma, config, out=None, keep_parts: bool = False,
               share: torch.Tensor | None = None):
    """One step for a prepared ``plan``: ``(out [B, H_q, D_v] in q's dtype, StepStats, parts)``,
    parts = (candidates, value gate, fallback mask) when ``keep_parts`` (else None). ``share``:
    the a-posteriori rule's estimate share per request ``[B]`` fp64 (default the config's)."""
    share = config.estimate_share if share is None else share
    batch, heads, _ = q.shape
    q32 = q.to(torch.float32)
    ex = exact_part(q32, k_cache, plan, sigma)
    rows = q32.view(batch, store.num_kv_heads, -1, q.shape[-1])[plan.page_req]
    bounds = store.page_bounds(rows, plan.page_ids)
    if config.threshold.band_pass:
        filt, cand = _a_posteriori(q32, k_cache, store, bounds, plan, ex, sigma, config, share)
        union, fallback = _fallback_mask(filt, plan, store.num_kv_heads, config)
    elif config.threshold.one_pass_a_posteriori:
        filt, cand, union, fallback = _one_pass_a_posteriori(q32, k_cache, store, bounds, plan, ex, sigma, config,
                                                             share)
    else:
        filt = run_filter(store, bounds, plan.page_ids, plan.page_req, ex.ref, ex.z_lb, ex.sample, sigma, config)
        union, fallback = _fallback_mask(filt, plan, store.num_kv_heads, config)
        cand = _candidates(q32, k_cache, filt, plan, fallback)
    gate = _value_gate(cand, filt, ex.ref, ex.z_dense, ex.z_lb, sigma, config, batch)
    result = _attend(q32, ex.s_dense, cand, gate, v_cache, plan, sigma, batch)
    result = _dense_for(fallback, result, q32, k_cache, v_cache, plan, sigma)
    if out is None:
        out = torch.empty((batch, heads, v_cache.shape[-1]), dtype=q.dtype, device=q.device)
    out.copy_(result)
    stats = _stats(filt, cand, gate, plan, union, fallback, store.num_kv_heads)
    return out, stats, ((cand, gate, fallback) if keep_parts else None)


def exact_part(q32: torch.Tensor, k_cache: torch.Tensor, plan: DecodePlan, sigma: float) -> ExactPart:
    """Exact scores of the dense part and the sample, the reference score and Z_lb. The masses
    take each part's scores lowered by their fp32 slack (``segments.part_slack``): lower bounds
    of the true keys' mass."""
    batch = plan.batch_size
    s_dense = exact_scores(q32, k_cache, plan.dense_slots, plan.dense_req)
    s_sample = exact_scores(q32, k_cache, plan.sample_slots, plan.sample_req)
    ref = seg_amax(torch.cat([s_dense, s_sample]), torch.cat([plan.dense_req, plan.sample_req]), batch)
    z_dense = _part_mass(q32, k_cache, s_dense, plan.dense_slots, plan.dense_req, ref, sigma)
    z_sample = _part_mass(q32, k_cache, s_sample, plan.sample_slots, plan.sample_req, ref, sigma)
    return ExactPart(s_dense, ref, z_dense, z_dense + z_sample, _pad_sample(s_sample, plan, batch))


def _part_mass(q32, k_cache, scores, slots, req, ref, sigma) -> torch.Tensor:
    """Σ exp(σ(s − slack − ref)) over a part's rows per (request, head), ``[B, H_q]`` fp64."""
    lowered = th.log_mass(scores, ref[req], sigma) - sigma * part_slack(q32, k_cache, slots, req)[req]
    return seg_sum(torch.exp(lowered), req, ref.shape[0])


@dataclass
class _Candidates:
    """Union candidates: one row per (indexed token, KV head) kept for any head of the group."""

    slots: torch.Tensor  # [Nc] int64
    kv_head: torch.Tensor  # [Nc] int64
    req: torch.Tensor  # [Nc] int64
    scores: torch.Tensor  # [Nc, G] fp32 exact scores of the group's query heads
    seg: torch.Tensor  # [Nc, G] int64 flat (request, query head) index of each score
    slack: torch.Tensor  # [Nc, G] fp64 bound on each score's fp32 error (numerics.score_slack)


def _candidates(q32, k_cache, filt: FilterResult, plan: DecodePlan, fallback) -> _Candidates:
    """The GQA-union candidates of ``filt`` (none for ``fallback`` requests), scored exactly."""
    h_kv = k_cache.shape[1]
    keep = filt.keep.view(len(filt.surviving), plan.page_size, h_kv, q32.shape[1] // h_kv)  # no -1: 0 pages
    union = keep.any(-1) & ~fallback[plan.page_req[filt.surviving]][:, None, None]
    return _score(q32, k_cache, union, filt.surviving, plan)


def _union_rows(filt: FilterResult, plan: DecodePlan, h_kv: int) -> torch.Tensor:
    """The GQA union of ``filt``'s candidates over every page row of the plan, ``[NP, P, H_kv]`` bool."""
    full = torch.zeros(len(plan.page_ids), plan.page_size, h_kv, dtype=torch.bool)
    groups = filt.keep.shape[-1] // h_kv
    full[filt.surviving] = filt.keep.view(len(filt.surviving), plan.page_size, h_kv, groups).any(-1)
    return full


def _a_posteriori(q32, k_cache, store, bounds, plan: DecodePlan, ex: ExactPart, sigma, config, share):
    """The a-posteriori certified rule (``filter.a_posteriori_filter`` / ``a_posteriori_second``):
    candidates at the first level are scored, their exact mass with the dense part's is Z_att,
    and the heads whose check fails add the band between the two levels (the final level's union
    minus the first's: no key is scored twice). Returns (FilterResult at the final level,
    candidates of both passes). ``share``: the estimate share, a float or ``[B]`` fp64."""
    heads = ex.ref.shape[1]
    h_kv = k_cache.shape[1]
    pb = bounds.page_bound.reshape(len(plan.page_ids), heads)
    tok = store.token_bounds(bounds, plan.page_ids).reshape(len(plan.page_ids), plan.page_size, heads)
    z_est = th.estimated_z(ex.z_dense, ex.z_lb - ex.z_dense, plan.num_indexed, ex.sample[1], share)
    first, level = a_posteriori_filter(pb, tok, plan.page_req, ex.ref, z_est, sigma, config)
    _, fallback = _fallback_mask(first, plan, h_kv, config)
    cand = _candidates(q32, k_cache, first, plan, fallback)
    z_att = _attended_z(cand, ex, sigma)
    filt = a_posteriori_second(level, ex.ref, z_att, sigma, config)
    if not bool(filt.lowered.any()):
        return filt, cand
    _, fallback = _fallback_mask(filt, plan, h_kv, config)
    extra = _union_rows(filt, plan, h_kv) & ~_union_rows(first, plan, h_kv)
    extra &= ~fallback[plan.page_req][:, None, None]
    return filt, _cat(cand, _score(q32, k_cache, extra, torch.arange(len(plan.page_ids)), plan))


def _one_pass_a_posteriori(q32, k_cache, store, bounds, plan: DecodePlan, ex: ExactPart, sigma, config, share):
    """The one-pass rule a posteriori (``filter.provisional_filter`` at Z_est,
    ``one_pass_a_posteriori_check`` against Z_att): the candidates at the provisional level are
    scored, their exact mass with the dense part's is Z_att (every candidate's, as the compiled
    step sums it before its fallback decision), and where a head was lowered the candidates are
    filtered and scored again at the final T (``share``: the estimate share, a float or ``[B]``
    fp64). Returns (FilterResult, candidates, union, fallback)."""
    batch, heads = ex.ref.shape
    h_kv = k_cache.shape[1]
    pb = bounds.page_bound.reshape(len(plan.page_ids), heads)
    tok = store.token_bounds(bounds, plan.page_ids).reshape(len(plan.page_ids), plan.page_size, heads)
    z_est = th.estimated_z(ex.z_dense, ex.z_lb - ex.z_dense, plan.num_indexed, ex.sample[1], share)
    provisional = provisional_filter(pb, tok, plan.page_req, ex.ref, z_est, sigma, config)
    cand = _candidates(q32, k_cache, provisional, plan, torch.zeros(batch, dtype=torch.bool))
    z_att = _attended_z(cand, ex, sigma)
    filt = one_pass_a_posteriori_check(provisional, pb, tok, plan.page_req, ex.ref, z_att, sigma, config)
    union, fallback = _fallback_mask(filt, plan, h_kv, config)
    if bool(filt.lowered.any()) or bool(fallback.any()):
        cand = _candidates(q32, k_cache, filt, plan, fallback)
    return filt, cand, union, fallback


def _attended_z(cand: _Candidates, ex: ExactPart, sigma) -> torch.Tensor:
    """Z_att ``[B, H_q]`` fp64: max(Z_lb, Z_dense + the exact mass of the union candidates ``cand``)."""
    return torch.maximum(ex.z_lb, ex.z_dense + _candidate_mass(cand, ex.ref, sigma, ex.ref.shape[0], gate=None))


def _cat(a: _Candidates, b: _Candidates) -> _Candidates:
    return _Candidates(*(torch.cat([getattr(a, f.name), getattr(b, f.name)]) for f in fields(_Candidates)))


def _candidate_mass(cand: _Candidates, ref, sigma, batch, gate, upper: bool = False) -> torch.Tensor:
    """Σ exp(σ(s − ref)) over candidate entries (those ``gate`` ``[Nc, G]`` attends, or all),
    per (request, query head) ``[B, H_q]`` fp64: a lower bound of the true keys' mass (each s
    lowered by its slack), or with ``upper`` an upper bound (raised by it)."""
    heads = ref.shape[1]
    shift = sigma * cand.slack if upper else -sigma * cand.slack
    mass = torch.exp((th.log_mass(cand.scores, ref.view(-1)[cand.seg], sigma) + shift).clamp(max=700.0))
    if gate is not None:
        mass = mass * gate
    out = torch.zeros(batch * heads, dtype=torch.float64)
    return out.index_add_(0, cand.seg.reshape(-1), mass.reshape(-1)).view(batch, heads)


def _score(q32, k_cache, union: torch.Tensor, rows: torch.Tensor, plan: DecodePlan) -> _Candidates:
    """Exact scores of the union candidates ``union`` ``[len(rows), P, H_kv]`` bool over the plan's
    page rows ``rows``: keys of candidates only."""
    batch, heads, dim = q32.shape
    h_kv = k_cache.shape[1]
    groups = heads // h_kv
    req_s = plan.page_req[rows]
    page_row, offset, kv_head = union.nonzero(as_tuple=True)
    slots = plan.page_ids[rows][page_row] * plan.page_size + offset
    req = req_s[page_row]
    keys = k_cache[slots, kv_head].to(torch.float32)  # [Nc, D]  keys of candidates only
    q_rows = q32.view(batch, h_kv, groups, dim)[req, kv_head]  # [Nc, G, D]
    scores = torch.einsum("nd,ngd->ng", keys, q_rows)
    seg = req[:, None] * heads + kv_head[:, None] * groups + torch.arange(groups)
    slack = score_slack(norm_up(q_rows), norm_up(keys)[:, None], dim)
    return _Candidates(slots, kv_head, req, scores, seg, slack)


@dataclass
class _Gate:
    """Which candidate entries are attended, and the final dropped-mass bound."""

    attend: torch.Tensor  # [Nc, G] bool
    mass_bound: torch.Tensor  # [B, H_q] fp64


def _value_gate(cand: _Candidates, filt, ref, z_dense, z_lb, sigma, config, batch) -> _Gate:
    """Skip V for candidates whose exact score is below T, counting their exact mass as dropped.

    Only the budget and fixed policies gate: a certified step attends every candidate, so its
    bound is the index bound alone.
    """
    flat = cand.seg
    z_final = torch.maximum(z_lb, z_dense + _candidate_mass(cand, ref, sigma, batch, gate=None))
    below = cand.scores < th.gate_threshold(filt.threshold).view(-1)[flat]
    gated = _candidate_mass(cand, ref, sigma, batch, gate=below, upper=True)
    allowed = torch.full_like(z_final, config.threshold.gates_values, dtype=torch.bool)
    attend = ~(below & allowed.view(-1)[flat])
    dropped = filt.dropped + gated * allowed
    return _Gate(attend, dropped / z_final)


def _attend(q32, s_dense, cand: _Candidates, gate: _Gate, v_cache, plan, sigma, batch) -> torch.Tensor:
    """Softmax over dense part + attended candidates, V read only for attended rows."""
    heads = q32.shape[1]
    h_kv, d_v = v_cache.shape[1], v_cache.shape[2]
    groups = heads // h_kv
    seg_d = plan.dense_req[:, None] * heads + torch.arange(heads)  # [ND, H_q]
    seg_c = cand.seg
    s_cand = torch.where(gate.attend, cand.scores, float("-inf"))
    m = torch.full((batch * heads,), float("-inf"))
    m.scatter_reduce_(0, seg_d.reshape(-1), s_dense.reshape(-1), reduce="amax")
    m.scatter_reduce_(0, seg_c.reshape(-1), s_cand.reshape(-1), reduce="amax")
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w_d = torch.exp(sigma * (s_dense - m[seg_d]))
    need = gate.attend.any(dim=1)  # V rows needed by at least one head of the group
    w_c = torch.exp(sigma * (s_cand[need] - m[seg_c[need]]))
    den = torch.zeros(batch * heads).index_add_(0, seg_d.reshape(-1), w_d.reshape(-1))
    den.index_add_(0, seg_c[need].reshape(-1), w_c.reshape(-1))
    v_d = v_cache[plan.dense_slots].to(torch.float32).repeat_interleave(groups, dim=1)
    num = torch.zeros(batch * heads, d_v).index_add_(0, seg_d.reshape(-1), (w_d[..., None] * v_d).reshape(-1, d_v))
    v_c = v_cache[cand.slots[need], cand.kv_head[need]].to(torch.float32)  # [Nv, D_v]
    num.index_add_(0, seg_c[need].reshape(-1), (w_c[..., None] * v_c[:, None, :]).reshape(-1, d_v))
    return (num / den[:, None]).view(batch, heads, d_v)


def _fallback_mask(filt: FilterResult, plan: DecodePlan, h_kv: int, config: LouverConfig):
    """(union candidates ``[B]``, requests whose union candidate fraction exceeds
    ``dense_fallback_fraction`` ``[B]`` bool)."""
    size = plan.page_size
    groups = filt.keep.shape[2] // h_kv
    union = filt.keep.view(len(filt.surviving), size, h_kv, groups).any(-1).sum((1, 2))
    count = seg_sum(union, plan.page_req[filt.surviving], plan.batch_size)
    total = (plan.num_indexed * h_kv).clamp(min=1)
    return count, count > config.dense_fallback_fraction * total


def _dense_for(fallback, result, q32, k_cache, v_cache, plan: DecodePlan, sigma) -> torch.Tensor:
    """Overwrite the rows of fallback requests with dense attention over all their tokens."""
    for b in fallback.nonzero()[:, 0].tolist():
        slots = torch.cat([
            plan.dense_slots[plan.dense_req == b],
            _page_slots(plan.page_ids[plan.page_req == b], plan.page_size),
        ])
        result[b] = dense_attention(q32[b], k_cache[slots], v_cache[slots], sigma)
    return result


def _page_slots(page_ids: torch.Tensor, size: int) -> torch.Tensor:
    return (page_ids[:, None] * size + torch.arange(size)).reshape(-1)


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sigma: float) -> torch.Tensor:
    """Dense decode attention of one request: q ``[H_q, D]``, keys/values ``[L, H_kv, D]`` -> ``[H_q, D_v]`` fp32."""
    h_q, h_kv = q.shape[0], keys.shape[1]
    # per KV head, its group of query heads at once: expanding K and V to the query heads cost 3x
    # the time at 32K tokens (the dense fallback's whole cost)
    q_grouped = q.to(torch.float32).reshape(h_kv, h_q // h_kv, -1)
    p = torch.softmax(sigma * torch.bmm(q_grouped, keys.to(torch.float32).permute(1, 2, 0)), dim=-1)
    return torch.bmm(p, values.to(torch.float32).transpose(0, 1)).reshape(h_q, -1)


def _pad_sample(s_sample: torch.Tensor, plan: DecodePlan, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample scores as ``[B, M, H_q]`` padded with −inf, and counts ``[B]``."""
    counts = torch.bincount(plan.sample_req, minlength=batch)
    width = int(counts.max()) if len(counts) else 0
    padded = torch.full((batch, width, s_sample.shape[1]), float("-inf"))
    start = torch.cumsum(counts, 0) - counts
    pos = torch.arange(len(plan.sample_req)) - start[plan.sample_req]
    padded[plan.sample_req, pos] = s_sample
    return padded, counts


def _stats(filt: FilterResult, cand: _Candidates, gate: _Gate, plan, union, fallback, h_kv: int) -> StepStats:
    batch, heads = filt.threshold.shape
    own = torch.zeros(batch * heads, dtype=torch.long).index_add_(
        0, cand.seg.reshape(-1), gate.attend.long().reshape(-1))
    values = torch.bincount(cand.req[gate.attend.any(1)], minlength=batch)
    return StepStats(
        threshold=filt.threshold, pages_skipped=filt.pages_skipped,
        candidates=torch.where(fallback[:, None], plan.num_indexed[:, None], own.view(batch, heads)),
        mass_bound=torch.where(fallback[:, None], torch.zeros_like(gate.mass_bound), gate.mass_bound),
        num_indexed=plan.num_indexed, num_pages=plan.num_pages,
        dense_fallback=fallback, values_read=torch.where(fallback, plan.num_indexed * h_kv, values),
        union_candidates=union.long(),
        pages_read=torch.bincount(plan.page_req[filt.surviving], minlength=batch),
        lowered=filt.lowered if filt.lowered is not None else torch.zeros(batch, heads, dtype=torch.bool),
    )




def attended_masks(cand: _Candidates, gate: _Gate, fallback, plan: DecodePlan, heads: int, num_slots: int):
    """Per request, bool ``[H_q, L]``: which token positions each query head attended (dense part,
    attended candidates, or everything under a dense fallback)."""
    size, page_table = plan.page_size, plan.page_table
    masks = []
    for b, n in enumerate(plan.seq_lens.tolist()):
        if bool(fallback[b]):
            masks.append(torch.ones((heads, n), dtype=torch.bool))
            continue
        pos = torch.arange(n)
        slot_to_pos = torch.full((num_slots,), -1, dtype=torch.long)
        slot_to_pos[page_table[b].long()[pos // size] * size + pos % size] = pos
        mask = torch.zeros((heads, n), dtype=torch.bool)
        mask[:, slot_to_pos[plan.dense_slots[plan.dense_req == b]]] = True
        mine = cand.req == b
        flat = cand.seg[mine]  # [Nc_b, G] flat (request, head) ids
        positions = slot_to_pos[cand.slots[mine]][:, None].expand_as(flat)
        attend = gate.attend[mine]
        mask[flat[attend] - b * heads, positions[attend]] = True
        masks.append(mask)
    return masks
