"""Shared helpers: fp64 brute force and paged KV fixtures."""

from __future__ import annotations

import math

import os

import pytest
import torch
from hypothesis import settings

# Without CUDA the Triton kernels run under the interpreter; it must be on before any test module
# imports them (kernels decorated before it stay compiled-only).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The Triton kernels' own tests take a minute each under the interpreter on two cores (a second on a
# GPU): where there is no CUDA they belong to the full tier (docs/testing.md), the conformance
# suite's interpreted rows of the first layout standing for them in the fast tier.
SLOW_WHERE_INTERPRETED = [pytest.mark.slow] if not torch.cuda.is_available() else []


def slow_where_interpreted(test):
    """``SLOW_WHERE_INTERPRETED`` on one test function."""
    for mark in SLOW_WHERE_INTERPRETED:
        test = mark(test)
    return test

# On CI (CI=true) a piece that should build here and does not fails the run instead of skipping
ON_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def skip_or_fail(reason: str, module: bool = False) -> None:
    """Skip the test (``module``: the whole module) naming ``reason`` (shown by ``-rs``); on CI
    fail it instead, so that a broken build cannot pass as a skip."""
    if ON_CI:
        pytest.fail(f"{reason} (on CI this fails the run)", pytrace=False)
    pytest.skip(reason, allow_module_level=module)


def implementations_here(device: str = "cpu") -> list[str]:
    """The decode implementations that run on ``device`` here; on CI every registered one must
    (the compiled CPU kernels and, under ``TRITON_INTERPRET=1``, both Triton ones): one that does
    not fails the collection with its reason (for ``cpu`` the compiler's message)."""
    from louver_sgl.decode.api import _unavailable, implementation_names

    names, missing = [], []
    for name in implementation_names():
        why = _unavailable(name, torch.device(device))
        (names if why is None else missing).append(name if why is None else f"{name}: {why}")
    if ON_CI and missing:
        raise RuntimeError("decode implementations that do not run here: " + "; ".join(missing))
    return names


def needs_impl(name: str) -> None:
    """Skip (on CI: fail) a test of implementation ``name`` where it does not run here."""
    from louver_sgl.decode.api import _unavailable

    why = _unavailable(name, torch.device("cpu"))
    if why is not None:
        skip_or_fail(f"decode implementation {name!r} unavailable: {why}")


settings.register_profile("ci", derandomize=True, deadline=None, max_examples=60, print_blob=True)
settings.register_profile("thorough", deadline=None, max_examples=3000, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def brute_force_scores(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Exact fp64 scores ``[H_q, N]`` of queries ``[H_q, D]`` against keys ``[N, H_kv, D]``."""
    groups = queries.shape[0] // keys.shape[1]
    k = keys.to(torch.float64).repeat_interleave(groups, dim=1)
    return torch.einsum("hd,nhd->hn", queries.to(torch.float64), k)


def assert_no_false_negatives(mask: torch.Tensor, scores: torch.Tensor, thresholds: torch.Tensor) -> None:
    """Recall exactly 1.0: every key with exact score >= T is in ``mask``."""
    exact = scores >= thresholds.to(torch.float64)[:, None]
    missed = exact & ~mask
    assert not bool(missed.any()), f"{int(missed.sum())} false negatives (recall < 1.0)"


def make_paged(lens, page_size, h_kv, dim, seed=0, dtype=torch.float32, spare_pages=2):
    """Random paged KV buffers with shuffled page ids: (k, v, page_table, seq_lens)."""
    gen = torch.Generator().manual_seed(seed)
    pages = [math.ceil(n / page_size) for n in lens]
    total = sum(pages) + spare_pages
    k = torch.randn(total * page_size, h_kv, dim, generator=gen)
    k[..., : dim // 8] += 3 * torch.randn(total * page_size, h_kv, 1, generator=gen)
    v = torch.randn(total * page_size, h_kv, dim, generator=gen)
    perm = torch.randperm(total, generator=gen)
    table = torch.zeros(len(lens), max(pages), dtype=torch.long)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[start : start + n]
        start += n
    return k.to(dtype), v.to(dtype), table, torch.tensor(lens)


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)


def fp64_request(q, k, v, page_table, seq_lens, b: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request b's fp64 brute force: scores ``[H_q, L]`` of its queries against its paged keys and
    its values ``[L, H_q, D_v]`` (KV heads repeated over their GQA groups)."""
    n = int(seq_lens[b])
    pos = torch.arange(n)
    slots = page_table[b, pos // page_size] * page_size + pos % page_size
    groups = q.shape[1] // k.shape[1]
    scores = torch.einsum("hd,lhd->hl", q[b].double(), k[slots].double().repeat_interleave(groups, 1))
    return scores, v[slots].double().repeat_interleave(groups, 1)


def compiled_attended(q, k, page_table, seq_lens, store, thresholds, kernel_bounds=False,
                      residual=None, weight_rule=None) -> list[torch.Tensor]:
    """The keys the compiled grid step attends at ``thresholds`` ``[B, H_q]`` (no value gate): per
    request a bool mask ``[H_q, L]``, True for the dense part and, per GQA group, for every token
    of the indexed pages that some head of the group keeps by its page bound and its int8 token
    bound (``int8_token_bounds_reference``, the bounds the kernel gates with; with
    ``kernel_bounds`` the kernel's own, from the ``certified_threshold`` op: the reference's fp32
    sums are ordered differently, so a bound within ~1e-5 of T can fall on the other side).
    ``residual``: the step's residual int8 weights (default: ``CpuLaunch``'s). ``weight_rule``:
    the int8 weights' rule of the reference bounds (default: this build's, ``Int8Rule.of_build``;
    the Triton kernels' is ``Int8Rule()``)."""
    from louver_sgl.decode.impl_cpu import CpuLaunch

    from louver_sgl.decode.reference_compiled import Int8Rule, int8_token_bounds_reference
    from louver_sgl.decode.plan import plan_decode

    config, size = store.config, store.page_size
    h_kv = store.num_kv_heads
    heads = q.shape[1]
    groups = heads // h_kv
    plan = plan_decode(page_table, seq_lens, config)
    rows = q.float().view(q.shape[0], h_kv, groups, -1)[plan.page_req]
    bounds = store.page_bounds(rows, plan.page_ids)
    residual = CpuLaunch().residual_weights if residual is None else residual
    if kernel_bounds:
        page_bound, tok = _kernel_bounds(q, plan, store, residual)
        page_bound, tok = page_bound.view(-1, h_kv, groups), tok.view(len(plan.page_ids), size, h_kv, groups)
    else:
        codes = store.page_codes(plan.page_ids)
        page_bound = bounds.page_bound
        rule = weight_rule or Int8Rule.of_build(config.grid_bits)  # this build's rule
        tok = int8_token_bounds_reference(*bounds.terms, codes, config.grid_bits, residual, rule)  # [n, P, H_kv, G]
    t = thresholds[plan.page_req].view(-1, 1, h_kv, groups)
    keep = (~(page_bound.unsqueeze(1) < t)) & ~(tok < t)
    union = keep.any(-1)  # [n, P, H_kv]
    masks = []
    for b, n in enumerate(seq_lens.tolist()):
        mask = torch.ones(heads, n, dtype=torch.bool)
        logical = {int(p): i for i, p in enumerate(page_table[b].tolist()[: -(-n // size)])}
        for row in (plan.page_req == b).nonzero()[:, 0].tolist():
            start = logical[int(plan.page_ids[row])] * size
            mask[:, start: start + size] = union[row].t().repeat_interleave(groups, 0)
        masks.append(mask)
    return masks


def _kernel_bounds(q, plan, store, residual: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled kernels' own page bounds ``[NP, H_q]`` and int8 token bounds ``[NP, P, H_q]``
    (the ``certified_threshold`` op's test outputs; its T is not used)."""
    from louver_sgl.decode import threshold as th
    from louver_sgl.decode.contract import EDGES
    from louver_sgl.decode.impl_cpu import compiled_ops

    batch, heads = q.shape[:2]
    n, size = len(plan.page_ids), store.page_size
    wide = lambda: torch.zeros(batch, heads, EDGES.hist_width, dtype=torch.float64)
    out = dict(hist=wide(), habs=wide(), t=torch.empty(batch, heads), tok=torch.empty(n, size, heads),
               certificate=torch.empty(batch, heads, dtype=torch.float64), pb=torch.empty(n, heads))
    compiled_ops().certified_threshold(
        q=q.float().contiguous(), page_ids=plan.page_ids, page_req=plan.page_req, **store.tensors,
        ref=torch.zeros(batch, heads), z_lb=torch.ones(batch, heads, dtype=torch.float64), sigma=1.0,
        eps_budget=0.5, rounding=th.HIST_ROUNDING, bits=store.config.grid_bits, page_size=size,
        residual_weights=residual, **EDGES.kernel_args(), **out)
    return out["pb"], out["tok"]


def cancelling_batch(lens, groups=3, h_kv=2, dim=64, seed=3, size=1000.0):
    """Keys whose products with the queries are large and cancel (a component of ``size`` times a
    unit vector orthogonal to the group's queries, plus a small one along them): their fp32 scores
    err by about 1e-3 in σ units, 30x the slack of the fp32 exps, so masses summed from the fp32
    scores alone exceed the true keys' mass. One query for every request."""
    gen = torch.Generator().manual_seed(seed)
    k, v, table, lens_t = make_paged(lens, 16, h_kv, dim, seed=seed)
    q = (torch.randn(1, h_kv * groups, dim, generator=gen) * 2).expand(len(lens), -1, -1).contiguous()
    for kv in range(h_kv):
        basis, _ = torch.linalg.qr(q[0, kv * groups:(kv + 1) * groups].double().T)  # [D, G]
        r = torch.randn(len(k), dim, generator=gen, dtype=torch.float64)
        perp = r - (r @ basis) @ basis.T
        along = torch.rand(len(k), 1, generator=gen, dtype=torch.float64) * 8 * basis[:, 0]
        k[:, kv] = (size * perp / perp.norm(dim=1, keepdim=True) * math.sqrt(dim) + along).float()
    return q, k, v, table, lens_t
