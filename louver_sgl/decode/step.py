"""The batched Louver decode step on paged KV tensors (fast CPU path, vectorised torch).

Order of work (design §6): exact scores of the dense part (sink pages, recent pages, tail) and of
the sample; page bounds; thresholds; token bounds of surviving pages; union of each GQA group's
candidates; exact scores of the candidates (keys first); values only for candidates that stay
attended; one numerically stable softmax over dense part + candidates per (request, head).
Requests whose candidate fraction exceeds ``dense_fallback_fraction`` run dense attention.
``reference.py`` is the specification this must match.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..config import LouverConfig
from ..index.store import PageIndexStore
from . import threshold as th
from .filter import FilterResult, run_filter
from .plan import DecodePlan, plan_decode
from .segments import exact_scores, seg_amax, seg_sum


@dataclass
class StepStats:
    """Per-step telemetry. Shapes: ``[B, H_q]`` unless noted.

    threshold (fp32), candidates (indexed keys attended per head; all under a dense fallback), pages_skipped, mass_bound
    (fp64 certified upper bound on the dropped softmax mass), num_indexed ``[B]``, num_pages ``[B]``,
    dense_fallback ``[B]`` bool, values_read ``[B]`` (V rows read for indexed keys, all KV heads),
    union_candidates ``[B]`` (candidate rows over all KV heads: keys read), pages_read ``[B]``
    (indexed pages whose codes were read because some head kept the page).
    """

    threshold: torch.Tensor
    candidates: torch.Tensor
    pages_skipped: torch.Tensor
    mass_bound: torch.Tensor
    num_indexed: torch.Tensor
    num_pages: torch.Tensor
    dense_fallback: torch.Tensor
    values_read: torch.Tensor
    union_candidates: torch.Tensor
    pages_read: torch.Tensor

    @classmethod
    def from_packed(cls, packed: torch.Tensor, num_indexed: torch.Tensor, num_pages: torch.Tensor) -> StepStats:
        """Statistics of the compiled step, packed as fp64 ``[B, H_q + 1, 4]`` (row h < H_q: head h's
        threshold, candidates, pages skipped, mass bound; row H_q: the request's dense fallback 0/1,
        union candidates, values read, pages read; kernels/cpu/stats.h). The fields are unpacked on
        first access: a step then creates one tensor for its statistics, not eight (at batch 1
        each costs microseconds once a layer has swept the caches)."""
        stats = cls.__new__(cls)
        stats.__dict__.update(_packed=packed, num_indexed=num_indexed, num_pages=num_pages)
        return stats

    def __getattr__(self, name: str):
        # only reached for attributes not yet set: the fields of a packed instance
        packed = self.__dict__.get("_packed")
        if packed is None or name not in _PACKED_FIELDS:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        heads = packed.shape[1] - 1
        per_head, per_req = packed[:, :heads], packed[:, heads]
        self.__dict__.update(
            threshold=per_head[..., 0].float(), candidates=per_head[..., 1].long(),
            pages_skipped=per_head[..., 2].long(), mass_bound=per_head[..., 3].contiguous(),
            dense_fallback=per_req[:, 0] != 0, union_candidates=per_req[:, 1].long(),
            values_read=per_req[:, 2].long(), pages_read=per_req[:, 3].long())
        del self.__dict__["_packed"]
        return self.__dict__[name]


_PACKED_FIELDS = frozenset(("threshold", "candidates", "pages_skipped", "mass_bound", "dense_fallback",
                            "union_candidates", "values_read", "pages_read"))


def louver_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    store: PageIndexStore,
    sigma: float,
    config: LouverConfig | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    chunk_pages: int = 64,
    plan: DecodePlan | None = None,
) -> tuple[torch.Tensor, StepStats]:
    """One decode step for a batch of requests.

    Args:
        q: ``[B, H_q, D]`` queries (any float dtype).
        k_cache, v_cache: ``[num_slots, H_kv, D]`` / ``[num_slots, H_kv, D_v]`` paged KV buffers.
        page_table: ``[B, max_pages]`` int page ids; seq_lens: ``[B]`` tokens per request.
        store: the page index (every full indexed page must be built).
        sigma: softmax scale. config: defaults to ``store.config`` (same index layout required).
        out: optional caller-owned ``[B, H_q, D_v]`` output buffer.
        backend: "torch" (vectorised torch), "cpp" (compiled CPU kernel, grid family), or "auto"
            (the compiled kernel where it applies and loads, else torch).
        chunk_pages: pages per split of the compiled kernel (a profile knob).
        plan: the host-side plan of ``page_table`` / ``seq_lens`` (``plan_decode``) when the caller
            shares one across layers; built here if None.

    Returns ``(out [B, H_q, D_v] in q's dtype, StepStats)``.
    """
    if plan is not None:
        # Fast path: a later step of a layer whose compiled step and the plan's buffers an earlier
        # step prepared; its inputs were checked then, q is checked by the kernel. Few Python
        # lines on purpose: after the layer's attention has swept
        # the caches each costs microseconds, and at batch 1 they were a sixth of a 32K step.
        compiled = store.compiled_steps.get((id(k_cache), id(v_cache), id(config), sigma, backend, chunk_pages))
        if compiled is not None:
            cpu = plan.derived.get(compiled.plan_key)
            if cpu is not None:
                return compiled.run(q, plan, cpu, out)
    config_arg, config = config, config or store.config
    _check_inputs(q, k_cache, v_cache, store, config)
    if plan is None:
        plan = plan_decode(page_table, seq_lens, config)
    elif plan.page_size != config.page_size or plan.batch_size != q.shape[0]:
        raise ValueError(f"plan is for page size {plan.page_size} and {plan.batch_size} requests, the step for "
                         f"page size {config.page_size} and {q.shape[0]}")
    compiled = _cpu_ops(backend, store, q)
    if compiled is not None:
        ops, run_decode_fused = compiled
        key = (id(k_cache), id(v_cache), id(config_arg), sigma, backend, chunk_pages)
        return run_decode_fused(q, k_cache, v_cache, plan, store, sigma, config, ops, chunk_pages, out, key)
    return run_decode(q, k_cache, v_cache, plan, store, sigma, config, out)


def gates_with_int8_bounds(store: PageIndexStore) -> bool:
    """Whether ``louver_decode`` (backend "auto") or the GPU step on ``store`` runs the compiled
    kernels, which gate tokens and certify T with int8 token bounds
    (``fused.int8_token_bounds_reference``) instead of the store's fp32 ones."""
    return store.config.family == "grid" and (not store.on_cpu or _compiled_ops() is not None)


def _cpu_ops(backend: str, store: PageIndexStore, q: torch.Tensor):
    """(compiled CPU module, fused step) if ``backend`` asks for them (or allows them) and they apply."""
    if backend not in ("auto", "torch", "cpp"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'cpp', got {backend!r}")
    applies = store.config.family == "grid" and store.on_cpu  # the kernel checks q's device
    if backend == "torch" or (backend == "auto" and not applies):
        return None
    if not applies:
        raise ValueError("the compiled CPU kernel supports the grid family on CPU tensors only")
    ops = _compiled_ops()
    if ops is None and backend == "cpp":
        raise RuntimeError("the compiled CPU kernel failed to build or load (see the log)")
    return ops


@functools.cache
def _compiled_ops():
    """The compiled CPU module and the fused step's entry point, or None if the module does not
    build here (resolved once: an import statement per layer call is measurable at batch 1)."""
    from louver_kernels.cpu_ops import cpu_ops_available, load_cpu_ops

    from .fused import run_decode_fused

    return (load_cpu_ops(), run_decode_fused) if cpu_ops_available() else None


def run_decode(q, k_cache, v_cache, plan: DecodePlan, store, sigma, config, out=None):
    """Device-side part of ``louver_decode`` for a prepared ``plan`` (same arguments)."""
    batch, heads, _ = q.shape
    q32 = q.to(torch.float32)
    ex = exact_part(q32, k_cache, plan, sigma)
    rows = q32.view(batch, store.num_kv_heads, -1, q.shape[-1])[plan.page_req]
    bounds = store.page_bounds(rows, plan.page_ids)
    filt = run_filter(store, bounds, plan.page_ids, plan.page_req, ex.ref, ex.z_lb, ex.sample, sigma, config)
    s_dense, ref, z_dense, z_lb = ex.s_dense, ex.ref, ex.z_dense, ex.z_lb
    fallback = _fallback_mask(filt, plan, store.num_kv_heads, config)
    cand = _candidates(q32, k_cache, filt, plan, fallback)
    gate = _value_gate(cand, filt, ref, z_dense, z_lb, sigma, config, batch)
    result = _attend(q32, s_dense, cand, gate, v_cache, plan, sigma, batch)
    result = _dense_for(fallback, result, q32, k_cache, v_cache, plan, sigma)
    if out is None:
        out = torch.empty((batch, heads, v_cache.shape[-1]), dtype=q.dtype, device=q.device)
    out.copy_(result)
    stats = _stats(filt, cand, gate, plan, fallback, batch)
    return out, stats


@dataclass
class ExactPart:
    """Exact scores computed before filtering: dense part ``s_dense`` ``[ND, H_q]``; ``ref`` (max
    exact score, fp32), ``z_dense`` and ``z_lb`` (fp64 masses relative to ref) ``[B, H_q]``;
    ``sample`` = (padded sample scores ``[B, M, H_q]``, counts ``[B]``)."""

    s_dense: torch.Tensor
    ref: torch.Tensor
    z_dense: torch.Tensor
    z_lb: torch.Tensor
    sample: tuple[torch.Tensor, torch.Tensor]


def exact_part(q32: torch.Tensor, k_cache: torch.Tensor, plan: DecodePlan, sigma: float) -> ExactPart:
    """Exact scores of the dense part and the sample, the reference score and Z_lb."""
    batch = plan.batch_size
    s_dense = exact_scores(q32, k_cache, plan.dense_slots, plan.dense_req)
    s_sample = exact_scores(q32, k_cache, plan.sample_slots, plan.sample_req)
    ref = seg_amax(torch.cat([s_dense, s_sample]), torch.cat([plan.dense_req, plan.sample_req]), batch)
    z_dense = seg_sum(torch.exp(th.log_mass(s_dense, ref[plan.dense_req], sigma)), plan.dense_req, batch)
    z_sample = seg_sum(torch.exp(th.log_mass(s_sample, ref[plan.sample_req], sigma)), plan.sample_req, batch)
    return ExactPart(s_dense, ref, z_dense, z_dense + z_sample, _pad_sample(s_sample, plan, batch))


@dataclass
class _Candidates:
    """Union candidates: one row per (indexed token, KV head) kept for any head of the group."""

    slots: torch.Tensor  # [Nc] int64
    kv_head: torch.Tensor  # [Nc] int64
    req: torch.Tensor  # [Nc] int64
    scores: torch.Tensor  # [Nc, G] fp32 exact scores of the group's query heads
    seg: torch.Tensor  # [Nc, G] int64 flat (request, query head) index of each score


def _candidates(q32, k_cache, filt: FilterResult, plan: DecodePlan, fallback) -> _Candidates:
    batch, heads, dim = q32.shape
    h_kv = k_cache.shape[1]
    groups = heads // h_kv
    keep = filt.keep.view(len(filt.surviving), plan.page_size, h_kv, groups)
    req_s = plan.page_req[filt.surviving]
    union = keep.any(-1) & ~fallback[req_s][:, None, None]
    page_row, offset, kv_head = union.nonzero(as_tuple=True)
    slots = plan.page_ids[filt.surviving][page_row] * plan.page_size + offset
    req = req_s[page_row]
    keys = k_cache[slots, kv_head].to(torch.float32)  # [Nc, D]  keys of candidates only
    q_rows = q32.view(batch, h_kv, groups, dim)[req, kv_head]  # [Nc, G, D]
    scores = torch.einsum("nd,ngd->ng", keys, q_rows)
    seg = req[:, None] * heads + kv_head[:, None] * groups + torch.arange(groups)
    return _Candidates(slots, kv_head, req, scores, seg)


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
    heads = ref.shape[1]
    flat = cand.seg
    x = th.log_mass(cand.scores, ref.view(-1)[flat], sigma)
    mass = torch.exp(x.clamp(max=700.0))
    z_cand = torch.zeros(batch * heads, dtype=torch.float64).index_add_(0, flat.reshape(-1), mass.reshape(-1))
    z_final = torch.maximum(z_lb, z_dense + z_cand.view(batch, heads))
    below = cand.scores < th.gate_threshold(filt.threshold).view(-1)[flat]
    gated = torch.zeros(batch * heads, dtype=torch.float64).index_add_(
        0, flat.reshape(-1), (mass * below).reshape(-1)
    ).view(batch, heads)
    allowed = torch.full_like(z_final, gates_values(config), dtype=torch.bool)
    attend = ~(below & allowed.view(-1)[flat])
    dropped = filt.dropped + gated * allowed
    return _Gate(attend, dropped / z_final)


def gates_values(config: LouverConfig) -> bool:
    """Whether candidates scoring below T skip their V read (budget and fixed policies)."""
    return config.value_gate and config.policy in ("budget", "fixed")


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


def _fallback_mask(filt: FilterResult, plan: DecodePlan, h_kv: int, config: LouverConfig) -> torch.Tensor:
    """Requests whose union candidate fraction exceeds ``dense_fallback_fraction``."""
    size = plan.page_size
    groups = filt.keep.shape[2] // h_kv
    union = filt.keep.view(len(filt.surviving), size, h_kv, groups).any(-1).sum((1, 2))
    count = seg_sum(union, plan.page_req[filt.surviving], plan.batch_size)
    total = (plan.num_indexed * h_kv).clamp(min=1)
    return count > config.dense_fallback_fraction * total


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


def _stats(filt: FilterResult, cand: _Candidates, gate: _Gate, plan, fallback, batch) -> StepStats:
    heads = filt.threshold.shape[1]
    own = torch.zeros(batch * heads, dtype=torch.long).index_add_(
        0, cand.seg.reshape(-1), gate.attend.long().reshape(-1))
    values = torch.bincount(cand.req[gate.attend.any(1)], minlength=batch)
    return StepStats(
        threshold=filt.threshold, pages_skipped=filt.pages_skipped,
        candidates=torch.where(fallback[:, None], plan.num_indexed[:, None], own.view(batch, heads)),
        mass_bound=torch.where(fallback[:, None], torch.zeros_like(gate.mass_bound), gate.mass_bound),
        num_indexed=plan.num_indexed, num_pages=plan.num_pages,
        dense_fallback=fallback, values_read=values,
        union_candidates=torch.bincount(cand.req, minlength=batch),
        pages_read=torch.bincount(plan.page_req[filt.surviving], minlength=batch),
    )


def _check_inputs(q, k_cache, v_cache, store: PageIndexStore, config: LouverConfig) -> None:
    # Few tensor calls on purpose: this runs for every layer, where each call into torch costs
    # microseconds once the layer's attention has swept the caches.
    qs, ks, vs = q.shape, k_cache.shape, v_cache.shape
    if len(qs) != 3 or len(ks) != 3 or len(vs) != 3:
        raise ValueError(
            f"q must be [B, H_q, D] and k/v caches [slots, H_kv, D]; got {tuple(qs)}, {tuple(ks)}, {tuple(vs)}"
        )
    if ks[:2] != vs[:2] or ks[1:] != (store.num_kv_heads, store.head_dim):
        raise ValueError("k/v caches do not match each other or the index (H_kv, D)")
    if qs[2] != store.head_dim or qs[1] % store.num_kv_heads:
        raise ValueError(f"q {tuple(qs)} does not match H_kv={store.num_kv_heads}, D={store.head_dim}")
    if config is not store.config and any(getattr(config, f) != getattr(store.config, f) for f in _LAYOUT):
        raise ValueError("config index layout differs from the store's; rebuild the index")


_LAYOUT = ("page_size", "family", "grid_bits", "n_subspaces", "cluster_size", "residual_norms")
