"""Decode step with the compiled CPU kernels for the grid family (same contract as the torch path).

The compiled attend pass does, per (request, chunk of pages) task and for every KV head, the page
bounds, token bounds, the GQA-union candidate gate, exact scores from candidate keys, the value
gate, an online softmax and the dropped-mass accounting; the chunks' partial softmax states are
then merged with the dense part. A step runs all of it (exact part and T included), the step
statistics and the output conversion as one call, ``LayerStep.run`` (``fused_step`` +
``step_stats``) over a layer side made once per layer (``CompiledLayer``) and a plan side made once
per forward pass (``StepPlan``). Certified steps choose T between the exact part and the attend
pass by one compiled pass over every page's codes (``certified_threshold``: the histogram of all
token bounds, the int8 ones the attend pass gates with). Every compiled phase has its torch
specification here or in step.py / threshold.py.
"""

from __future__ import annotations

import torch

from ..config import LouverConfig
from ..index.grid import unpack_codes
from ..index.store import PageIndexStore
from . import threshold as th
from .plan import DecodePlan
from .segments import seg_sum
from .step import ExactPart, StepStats, gates_values


def page_chunks(plan: DecodePlan, chunk_pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split each request's page rows into chunks: (chunk_req, begin, end) ``[NC]`` int64.

    One chunk is one task of the kernel's shared task counter. Chunk sizes shrink towards the end
    of the batch (guided scheduling): a chunk takes at most ``chunk_pages`` pages and at most
    1/(GUIDED_SHARE · threads) of the pages left, so the first tasks are large (few partial states
    to merge) and the last ones single pages (the cores finish together). Host-side planning over
    the plan's page counts (a few requests: plain lists are cheaper than a dozen small tensor ops).
    """
    share = GUIDED_SHARE * torch.get_num_threads()
    left = sum(plan.pages_per_request)
    req, begin, end = [], [], []
    start = 0
    for b, count in enumerate(plan.pages_per_request):
        first, stop = start, start + count
        while first < stop:
            size = max(1, min(chunk_pages, -(-left // share), stop - first))
            req.append(b)
            begin.append(first)
            end.append(first + size)
            first += size
            left -= size
        start = stop
    as_tensor = lambda x: torch.tensor(x, dtype=torch.long)
    return as_tensor(req), as_tensor(begin), as_tensor(end)


# A chunk takes at most 1/(GUIDED_SHARE · threads) of the pages left: against an even split into 16
# chunks per thread this measured 5-8 % faster at 32K, batch 1 (less waiting at the end).
GUIDED_SHARE = 2


def run_decode_fused(q, k_cache, v_cache, plan: DecodePlan, store: PageIndexStore, sigma: float,
                     config: LouverConfig, ops, chunk_pages: int, out=None, cache_key=None):
    """Fused-kernel version of ``run_decode`` (grid family, CPU tensors).

    One compiled call (``CompiledLayer.run``); with ``cache_key`` its layer side is kept in
    ``store.compiled_steps`` for ``louver_decode``'s fast path. The task list and the output
    buffers come from the plan (made once per forward pass, reused by every layer): at batch 1 the
    step's own host work is a large share of its time.
    """
    batch, heads, dim = q.shape
    h_kv, d_v = store.num_kv_heads, v_cache.shape[-1]
    threads = torch.get_num_threads()
    chunk_req, begin, end = plan.cached(("cpu_chunks", chunk_pages, threads), lambda: page_chunks(plan, chunk_pages))
    part = plan.cached(("cpu_outputs", chunk_pages, threads, heads, h_kv, d_v, config.sample_size),
                       lambda: _Outputs(batch, heads, h_kv, d_v, len(chunk_req), len(plan.dense_slots),
                                        config.sample_size))
    plan_key = ("cpu_step", config.page_size, chunk_pages, threads, heads, h_kv, dim, d_v, config.sample_size)
    cpu = plan.cached(plan_key, lambda: _step_plan(ops, plan, (chunk_req, begin, end), part, dim))
    compiled = CompiledLayer(ops, k_cache, v_cache, store, sigma, config, plan_key)
    if cache_key is not None:
        steps = store.compiled_steps
        if len(steps) >= MAX_COMPILED_STEPS:  # entries keep their KV caches alive
            steps.clear()
        steps[cache_key] = compiled
    return compiled.run(q, plan, cpu, out)


def _dense_layer(ops, k_cache, v_cache, store: PageIndexStore, sigma: float):
    """The dense policy's ``LayerStep`` over a layer's caches and index (T = −inf: every key is a
    candidate and attended), for the requests of a step that fall back to dense."""
    meta = store.tensors
    return ops.LayerStep(k_cache, v_cache, meta["lo"], meta["scale"], meta["radius"], meta["codes"], float(sigma),
                         -1.0, float("-inf"), False, store.config.grid_bits, store.page_size, 1.0, -1.0, 0.0)


def _dense_fallback(dense_layer, q, cpu: tuple, stats: StepStats, out: torch.Tensor) -> None:
    """Rows of ``out`` of the requests over the fallback fraction replaced by the dense policy's
    compiled step on the same plan (its buffers are free again once ``out`` and the statistics are
    written). The torch dense path gathered and widened every K and V row: a certified step at 32K
    that falls back took 26 ms with it, 5.1 ms with this."""
    dense_out, _, _ = dense_layer.run(q, cpu[2], None)
    rows = stats.dense_fallback
    out[rows] = dense_out[rows]


# Compiled layer steps one index store keeps (each keeps its KV caches alive; a server has one
# per layer and store).
MAX_COMPILED_STEPS = 16


class CompiledLayer:
    """One layer's compiled one-call step: the layer side (``ops.LayerStep``: KV caches, index,
    policy scalars; and the dense policy's for fallbacks) and the key of the plan side it runs on
    (``StepPlan`` in ``plan.derived``). Made by a layer's first step; ``louver_decode`` keeps it in
    the store so that later steps skip straight to ``run``."""

    __slots__ = ("layer", "dense_layer", "plan_key", "k_cache", "v_cache", "sigma", "config")

    def __init__(self, ops, k_cache, v_cache, store: PageIndexStore, sigma: float, config: LouverConfig,
                 plan_key: tuple):
        t_static = th.static_threshold_value(config)
        certified = config.policy == "certified"
        meta = store.tensors
        self.layer = ops.LayerStep(
            k_cache, v_cache, meta["lo"], meta["scale"], meta["radius"], meta["codes"], float(sigma),
            float(config.budget if config.policy == "budget" else -1.0), 0.0 if t_static is None else t_static,
            gates_values(config), store.config.grid_bits, store.page_size, float(config.dense_fallback_fraction),
            config.eps * th.BUDGET_SAFETY if certified else -1.0, th.HIST_ROUNDING)
        self.dense_layer = _dense_layer(ops, k_cache, v_cache, store, sigma)
        # the caches and the config stay referenced: the store's key holds their id()s, which must
        # not be reused while the entry lives
        self.plan_key, self.k_cache, self.v_cache, self.sigma, self.config = plan_key, k_cache, v_cache, sigma, config

    def run(self, q, plan: DecodePlan, cpu: tuple, out=None):
        """One step: ``(out [B, H_q, D_v] in q's dtype, StepStats)``; ``cpu`` is
        ``plan.derived[self.plan_key]``. Requests over the fallback fraction get dense attention."""
        out, packed, any_fallback = self.layer.run(q, cpu[2], out)
        stats = StepStats.from_packed(packed, plan.num_indexed, plan.num_pages)
        if any_fallback:
            _dense_fallback(self.dense_layer, q, cpu, stats, out)
        return out, stats


def _step_plan(ops, plan: DecodePlan, chunks: tuple, part: "_Outputs", dim: int):
    """The plan side of ``CompiledLayer.run``: (part, q32 ``[B, H_q, D]`` fp32, ``ops.StepPlan``)."""
    batch, heads = part.ref.shape
    q32 = torch.empty(batch, heads, dim)
    step_plan = ops.StepPlan(
        [plan.dense_slots, plan.dense_req, plan.sample_slots, plan.sample_req, plan.page_ids, *chunks,
         plan.num_indexed, plan.page_req],
        [q32, *part.exact, part.t, part.gate, *part.attend, part.result, *part.totals, part.z_lb, part.hist,
         part.habs, part.certificate])
    return part, q32, step_plan


def step_stats_reference(t, z, per_head, per_req, masses, index_dropped, num_indexed, fallback_fraction, h_kv):
    """The specification of the compiled ``step_stats`` (which packs them, see
    ``StepStats.from_packed``): (threshold, candidates, pages_skipped, mass_bound, dense_fallback,
    counts) as new tensors (shapes in the op's comment) and whether any request falls back to
    dense. The bound is (index-dropped + value-gated mass) / Z with Z
    the larger of the exact part's lower bound and the dense part plus every union candidate;
    requests over the fallback fraction attend densely (bound 0, every indexed key a candidate)."""
    fallback = per_req[:, 0] > fallback_fraction * (num_indexed * h_kv).clamp(min=1)
    z_final = torch.maximum(z[..., 0] + z[..., 1], z[..., 0] + masses[..., 2])
    dropped = index_dropped if index_dropped.numel() else masses[..., 0]
    bound = torch.where(fallback[:, None], 0.0, (dropped + masses[..., 1]) / z_final)
    candidates = torch.where(fallback[:, None], num_indexed[:, None], per_head[..., 0])
    fields = (t.clone(), candidates, per_head[..., 1].clone(), bound, fallback, per_req.clone())
    return fields, bool(fallback.any())


class _Outputs:
    """The compiled step's output buffers (made once per plan, see ``run_decode_fused``; shapes in
    the op comments)."""

    def __init__(self, batch, heads, h_kv, d_v, n_chunks, n_dense, sample_size):
        groups = heads // h_kv
        self.s_dense = torch.empty(n_dense, heads)
        self.sample = torch.empty(batch, sample_size, heads)
        self.ref = torch.empty(batch, heads)
        self.z = torch.empty(batch, heads, 2, dtype=torch.float64)
        self.t = torch.empty(batch, heads)
        self.gate = torch.empty(batch, heads)
        self.m = torch.empty(n_chunks, h_kv, groups)
        self.l = torch.empty(n_chunks, h_kv, groups)
        self.o = torch.empty(n_chunks, h_kv, groups, d_v)
        self.counts = torch.empty(n_chunks, h_kv, 2 * groups + 3, dtype=torch.long)
        self.mass = torch.empty(n_chunks, h_kv, groups, 3, dtype=torch.float64)
        self.result = torch.empty(batch, heads, d_v)
        self.totals = (torch.empty(batch, heads, 2, dtype=torch.long), torch.empty(batch, 3, dtype=torch.long),
                       torch.empty(batch, heads, 3, dtype=torch.float64))
        width = th.EDGE_COUNT + 2
        self.hist = torch.empty(batch, heads, width, dtype=torch.float64)
        self.habs = torch.empty(batch, heads, width, dtype=torch.float64)
        self.certificate = torch.empty(batch, heads, dtype=torch.float64)
        self.z_lb = torch.empty(batch, heads, dtype=torch.float64)

    @property
    def exact(self):
        return self.s_dense, self.sample, self.ref, self.z

    @property
    def attend(self):
        return self.m, self.l, self.o, self.counts, self.mass

    def exact_part(self, plan: DecodePlan) -> ExactPart:
        z = self.z
        return ExactPart(self.s_dense, self.ref, z[..., 0], z[..., 0] + z[..., 1], (self.sample, plan.samples_per_request))


def _exact(ops, q32, k_cache, plan: DecodePlan, sigma: float, part: _Outputs, budget: float) -> ExactPart:
    ops.exact_part(q32, k_cache, plan.dense_slots, plan.dense_req, plan.sample_slots, plan.sample_req,
                   float(sigma), float(budget), *part.exact, part.t)
    return part.exact_part(plan)


def chunk_totals_reference(counts, mass, chunk_req, batch):
    """Per-request totals of the attend kernel's chunk outputs: per_head ``[B, H_q, 2]`` (attended,
    pages skipped), per_req ``[B, 3]`` (union candidates, values read, pages read of KV head 0's
    task), masses ``[B, H_q, 3]``. The specification of the compiled ``chunk_totals``."""
    n_chunks, h_kv, width = counts.shape
    groups = (width - 3) // 2
    heads = h_kv * groups
    per_head = seg_sum(torch.stack([counts[..., :groups], counts[..., groups: 2 * groups]], -1)
                       .reshape(n_chunks, heads, 2), chunk_req, batch)
    per_req = seg_sum(torch.stack([counts[..., 2 * groups].sum(1), counts[..., 2 * groups + 1].sum(1),
                                   counts[:, 0, 2 * groups + 2]], -1), chunk_req, batch)
    masses = seg_sum(mass.reshape(n_chunks, heads, 3), chunk_req, batch)
    return per_head, per_req, masses


def compiled_exact_part(q32, k_cache, plan: DecodePlan, sigma: float, sample_size: int, ops,
                        budget: float = -1.0) -> tuple[ExactPart, torch.Tensor | None]:
    """``step.exact_part`` in one compiled call (the sample padded to ``sample_size`` rows, which
    the budget quantile does not see: padding is −inf), and with ``budget`` >= 0 the budget
    policy's T ``[B, H_q]`` (else None)."""
    batch, heads = q32.shape[:2]
    part = _Outputs(batch, heads, k_cache.shape[1], k_cache.shape[2], 0, len(plan.dense_slots), sample_size)
    ex = _exact(ops, q32, k_cache, plan, sigma, part, budget)
    return ex, (part.t if budget >= 0 else None)


def int8_token_bounds_reference(weights, offset, codes, bits):
    """The attend pass's int8 token bounds: the specification of the compiled ones.

    Each head's page weights w (``grid_query_terms``) become ``step·wq`` with ``wq`` int8
    (step = max|w| / 127, rounded to nearest); the bound is offset + slack + step·Σ wq·code with
    the integer sum exact, where slack covers the channels rounded down (codes are never negative)
    and fp32 rounding. weights ``[n, H_kv, G, D]``, offset ``[n, H_kv, G]`` fp32; codes ``[n, P,
    H_kv, B]`` packed -> ``[n, P, H_kv, G]`` fp32.
    """
    top = weights.abs().amax(-1, keepdim=True)
    step = torch.where(top > 0, top / 127.0, torch.ones_like(top))
    wq = torch.round(weights * (1.0 / step)).clamp(-127, 127)
    err = (weights - step * wq).clamp(min=0).sum(-1)
    mag = (step * wq).abs().sum(-1)
    slack = ((1 << bits) - 1) * (err * (1 + 2.0**-16) + mag * 2.0**-20) + 2.0**-126
    slack = torch.where(torch.isfinite(top[..., 0]), slack, float("nan"))
    dots = torch.einsum("npkd,nkgd->npkg", unpack_codes(codes, bits).long(), wq.long())
    return (offset + slack).unsqueeze(1) + step[..., 0].unsqueeze(1) * dots.float()


def certified_threshold_reference(pb, tok, page_req, ref, z_lb, sigma: float, eps_budget: float,
                                  rounding: float):
    """The specification of the compiled ``certified_threshold`` given its bounds: page bounds
    ``[NP, H_q]`` and token bounds ``[NP, P, H_q]`` fp32 -> (T ``[B, H_q]`` fp32, certificate
    ``[B, H_q]`` fp64, hist and habs ``[B, H_q, EDGE_COUNT + 2]`` fp64).

    hist is ``filter._certified_mass``'s histogram (pages whole at their bin, tokens below their
    page's bin at theirs, minus the same at the page's); habs sums the absolute terms. The mass
    dropped at edge j is bounded by cumsum(hist)[j] + rounding·cumsum(habs)[j] (fp64 rounding of
    the sums in any order); T is the largest edge whose bound fits eps_budget·Z_lb.
    """
    batch, heads = ref.shape
    size = tok.shape[1]
    tok = torch.minimum(tok, pb[:, None, :])
    x_page, x_tok = th.log_mass(pb, ref[page_req], sigma), th.log_mass(tok, ref[page_req][:, None, :], sigma)
    b_page, b_tok = th.edge_bins(x_page), th.edge_bins(x_tok)
    mass_page = size * torch.exp(x_page.clamp(max=700.0)).nan_to_num(nan=0.0)
    mass_tok = torch.exp(x_tok.clamp(max=700.0)).nan_to_num(nan=0.0) * (b_tok < b_page[:, None, :])
    width = th.EDGE_COUNT + 2
    seg = (page_req[:, None] * heads + torch.arange(heads)) * width
    parts = []
    for index, mass in (((seg + b_page), mass_page), ((seg[:, None, :] + b_tok), mass_tok),
                        ((seg + b_page), mass_tok.sum(1))):
        parts.append(torch.zeros(batch * heads * width, dtype=torch.float64).index_add_(
            0, index.reshape(-1), mass.reshape(-1)).view(batch, heads, width))
    hist, habs = parts[0] + parts[1] - parts[2], parts[0] + parts[1] + parts[2]
    bound = (hist.cumsum(-1) + rounding * habs.cumsum(-1))[..., : th.EDGE_COUNT]
    edge = th.pick_edge(bound, eps_budget * z_lb)
    cert = torch.where(edge < 0, 0.0, bound.gather(-1, edge.clamp(min=0)[..., None])[..., 0])
    return th.edge_threshold(edge, ref, sigma), cert, hist, habs


def merge_reference(ex, m, l, o, chunk_req, v_cache, plan: DecodePlan, sigma, batch) -> torch.Tensor:
    """Merge chunk softmax states (m in σ·score units) with the dense part: ``[B, H_q, D_v]``.

    The specification of the compiled ``merge_chunks`` (tested against it)."""
    n_chunks = len(chunk_req)
    heads, d_v = ex.s_dense.shape[1], v_cache.shape[-1]
    groups = heads // v_cache.shape[1]
    x_d = sigma * ex.s_dense  # [ND, H_q]
    m_c = m.view(n_chunks, heads)
    top = torch.full((batch, heads), float("-inf"))
    top.scatter_reduce_(0, plan.dense_req[:, None].expand_as(x_d), x_d, reduce="amax")
    top.scatter_reduce_(0, chunk_req[:, None].expand_as(m_c), m_c, reduce="amax")
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w_d = torch.exp(x_d - top[plan.dense_req])
    v_d = v_cache[plan.dense_slots].to(torch.float32).repeat_interleave(groups, dim=1)
    scale_c = torch.exp(m_c - top[chunk_req])  # 0 for empty chunks (m = −inf)
    den = seg_sum(w_d, plan.dense_req, batch) + seg_sum(l.view(n_chunks, heads) * scale_c, chunk_req, batch)
    num = seg_sum(w_d[..., None] * v_d, plan.dense_req, batch)
    num += seg_sum(o.view(n_chunks, heads, d_v) * scale_c[..., None], chunk_req, batch)
    return num / den[..., None]
