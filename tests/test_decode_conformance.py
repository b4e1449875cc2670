"""Every decode implementation available here means the same by every option.

The same cases (policies, page sizes, GQA groupings, partial pages, KV dtypes, short requests
under ``min_sparse_tokens``, dense fallbacks, sink and recent pages, the value gate, a NaN key)
run through ``LouverDecode`` on each implementation this machine has (``torch``; ``cpu`` where
the kernels build; ``triton`` under the Triton interpreter, fp16/fp32 only), and each result is
held against an fp64 brute force and the reference's layout:

* recall exactly 1.0: every key whose exact score reaches the step's T is attended;
* the true dropped softmax mass is at most the reported bound (certified: the bound is < eps);
* the output is fp64 softmax attention over the attended set, and within 2·bound·max|v| of dense;
* the layout (indexed tokens and pages, short requests dense) is the reference's, and a request
  falls back to dense exactly when its union candidates exceed the fraction (then it attends
  every key, bound 0).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the Triton implementation is first imported

from conftest import fp64_request, implementations_here, make_paged  # noqa: E402
from louver_sgl import LouverConfig, PageIndexStore  # noqa: E402
from louver_sgl.decode import LouverDecode  # noqa: E402
from louver_sgl.decode.contract import RequestLayout  # noqa: E402

IMPLS = implementations_here("cpu")  # on CI: every registered one, or the collection fails
LENS = [300, 701, 20, 64, 129]
POLICIES = {"certified": dict(policy="certified", eps=0.05),
            "certified-one-pass": dict(policy="certified", eps=0.05, certified_passes=1),
            "certified-a-posteriori": dict(policy="certified", eps=0.05, certified_rule="a_posteriori"),
            "certified-one-pass-a-posteriori": dict(policy="certified", eps=0.05, certified_passes=1,
                                                    certified_rule="a_posteriori"),
            "budget": dict(policy="budget", budget=0.1),
            "fixed": dict(policy="fixed", fixed_threshold=3.0), "dense": dict(policy="dense")}
# (name, page size, KV heads, group size, extra config)
LAYOUTS = [
    ("p16-gqa3", 16, 2, 3, {}),
    ("p32-mqa4-no-sink", 32, 1, 4, dict(sink_pages=0, recent_pages=2)),
    ("p16-mha-short-and-fallback", 16, 4, 1, dict(min_sparse_tokens=128, dense_fallback_fraction=0.3)),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _case(impl, policy, layout, dtype, value_gate=True, seed=0):
    name, size, h_kv, groups, extra = layout
    if impl.startswith("triton") and dtype == torch.bfloat16:
        pytest.skip("bf16 tl.dot is not faithful under the Triton interpreter (GPU runs cover it)")
    config = LouverConfig(page_size=size, sample_size=32, value_gate=value_gate, **POLICIES[policy], **extra)
    k, v, table, lens = make_paged(LENS, size, h_kv, 64, seed=seed, dtype=dtype)
    layout_kw = dict(code_layout="token") if impl.startswith("triton") else {}
    store = PageIndexStore(config, len(k) // size, h_kv, 64, dtype, **layout_kw)
    store.build_pages(k, torch.arange(store.num_pages))
    q = (torch.randn(len(LENS), h_kv * groups, 64, generator=torch.Generator().manual_seed(seed + 1)) * 2).to(dtype)
    return config, q, k, v, table, lens, store


def _step(impl, config, q, k, v, table, lens, store, sigma):
    """(out, stats, attended masks) of one step through the wrapper: every implementation returns
    the key set it attended itself (the compiled CPU step from its attend pass's own gate)."""
    try:
        decode = LouverDecode(config, "cpu", impl=impl, launch={"chunk_pages": 3} if impl == "cpu" else None)
    except ValueError as exc:  # an option this implementation refuses, by name
        refused = (f"certified_passes=1 is not supported by the '{impl}'",
                   f"certified_rule='a_posteriori' is not supported by the '{impl}'")
        if any(r in str(exc) for r in refused):
            pytest.skip(str(exc))
        raise
    decode.plan(table, lens)
    step_result = decode.run(q, k, v, store, sigma, attended=True)
    return step_result.out, step_result.stats, step_result.attended


def _check_step(config, q, k, v, table, lens, store, sigma, out, stats, masks):
    layout = RequestLayout.of(config)
    h_kv = k.shape[1]
    assert torch.equal(stats.num_indexed.cpu(), layout.indexed_tokens(lens)), "layout differs from the reference's"
    limit = config.dense_fallback_fraction * (stats.num_indexed.cpu() * h_kv).clamp(min=1)
    assert torch.equal(stats.dense_fallback.cpu(), stats.union_candidates.cpu() > limit)
    if config.policy == "certified":
        assert bool((stats.mass_bound.cpu() < config.eps).all())
    tol = 2e-5 if q.dtype == torch.float32 else 8e-3
    for b in range(len(LENS)):
        scores, values = fp64_request(q, k, v, table, lens, b, config.page_size)
        mask, bound, t = masks[b], stats.mass_bound[b].cpu(), stats.threshold[b].cpu().double()
        assert not bool(((scores >= t[:, None]) & ~mask).any()), f"request {b}: a key scoring >= T was not attended"
        if int(stats.num_indexed[b]) == 0 or bool(stats.dense_fallback[b]):
            assert bool(mask.all()) and float(bound.abs().max()) == 0.0, f"request {b} is dense"
        p_all = torch.softmax(sigma * scores, dim=1)
        assert bool(((p_all * ~mask).sum(1) <= bound + 1e-9).all()), f"request {b}: dropped mass above the bound"
        p = torch.softmax(sigma * scores.masked_fill(~mask, -math.inf), dim=1)
        scale = float(values.abs().max())
        torch.testing.assert_close(out[b].double().cpu(), torch.einsum("hl,lhd->hd", p, values),
                                   atol=tol * scale, rtol=0)
        dense = torch.einsum("hl,lhd->hd", p_all, values)
        err = (out[b].double().cpu() - dense).abs().amax(1)
        assert bool((err <= 2 * bound * scale + tol * scale).all()), f"request {b}: output beyond its bound"
        counted = mask.sum(1) - (int(lens[b]) - int(stats.num_indexed[b]))
        assert torch.equal(counted, stats.candidates[b].cpu()), f"request {b}: counts differ from the attended set"


def _interpreted(impl: str) -> bool:
    """Whether ``impl`` runs here under the Triton interpreter (seconds per case, not milliseconds)."""
    return impl.startswith("triton") and os.environ.get("TRITON_INTERPRET") == "1"


def _slow_if(condition: bool) -> list:
    return [pytest.mark.slow] if condition else []


# Every implementation on every layout with every policy. The interpreted Triton rows (up to a
# minute each on two cores) run in the fast tier only where they decide T or certify: the first
# layout's budget and certified rows, and the p32 layout's a-posteriori row (the fast tier once
# missed it reporting a bound above eps). The rest belong to the full tier.
FAST_INTERPRETED = {("p16-gqa3", "budget"), ("p16-gqa3", "certified"), ("p16-gqa3", "certified-a-posteriori"),
                    ("p32-mqa4-no-sink", "certified-a-posteriori")}
IMPL_CASES = [pytest.param(impl, layout, policy, id=f"{layout[0]}-{impl}-{policy}",
                           marks=_slow_if(_interpreted(impl) and (layout[0], policy) not in FAST_INTERPRETED))
              for impl in IMPLS for layout in LAYOUTS for policy in POLICIES]


@pytest.mark.parametrize("impl,layout,policy", IMPL_CASES)
def test_every_implementation_keeps_the_contract(impl, policy, layout):
    dtype = {"p16-gqa3": torch.float16, "p32-mqa4-no-sink": torch.float32}.get(layout[0], torch.float16)
    config, q, k, v, table, lens, store = _case(impl, policy, layout, dtype)
    sigma = 1 / math.sqrt(64)
    out, stats, masks = _step(impl, config, q, k, v, table, lens, store, sigma)
    _check_step(config, q, k, v, table, lens, store, sigma, out, stats, masks)
    if layout[0].endswith("fallback") and policy != "dense":
        short = lens < config.min_sparse_tokens
        assert bool(short.any()) and bool((stats.num_indexed[short] == 0).all())


# interpreted Triton: fp16 with the value gate in the fast tier, the other three in the full one
DTYPE_CASES = [pytest.param(impl, dtype, gate, id=f"{gate}-{str(dtype).replace('torch.', '')}-{impl}",
                            marks=_slow_if(_interpreted(impl) and (dtype != torch.float16 or not gate)))
               for gate in (True, False) for dtype in DTYPES for impl in IMPLS]


@pytest.mark.parametrize("impl,dtype,value_gate", DTYPE_CASES)
def test_dtypes_and_the_value_gate(impl, dtype, value_gate):
    config, q, k, v, table, lens, store = _case(impl, "budget", LAYOUTS[0], dtype, value_gate=value_gate, seed=5)
    sigma = 1 / math.sqrt(64)
    out, stats, masks = _step(impl, config, q, k, v, table, lens, store, sigma)
    _check_step(config, q, k, v, table, lens, store, sigma, out, stats, masks)


@pytest.mark.parametrize("impl", [pytest.param(impl, marks=_slow_if(_interpreted(impl) and impl != "triton"))
                                  for impl in IMPLS])
def test_forced_fallback_attends_densely(impl):
    """A fraction no request stays under: every request with indexed pages falls back to exact
    dense attention, bound 0, on every implementation."""
    layout = ("p16-gqa3", 16, 2, 3, dict(dense_fallback_fraction=1e-6))
    config, q, k, v, table, lens, store = _case(impl, "budget", layout, torch.float32, seed=2)
    sigma = 1 / math.sqrt(64)
    out, stats, masks = _step(impl, config, q, k, v, table, lens, store, sigma)
    assert bool(stats.dense_fallback[stats.num_indexed > 0].all())
    _check_step(config, q, k, v, table, lens, store, sigma, out, stats, masks)


@pytest.mark.parametrize("impl,bad", [
    pytest.param(impl, bad, id=f"{impl}-{name}",
                 marks=_slow_if(_interpreted(impl) and (name != "nan" or impl == "triton_tiled")))
    for impl in IMPLS for name, bad in (("nan", float("nan")), ("inf", float("inf")), ("-inf", -float("inf")))])
def test_a_nan_key_is_kept_and_touches_no_other_request(impl, bad):
    """A NaN or infinite component in one key of request 0's indexed pages: no error; the key is
    attended by every head of its KV group (NaN or infinite bounds keep); every other request's
    output is the same as without it."""
    config, q, k, v, table, lens, store = _case(impl, "budget", LAYOUTS[0], torch.float32, seed=3)
    sigma = 1 / math.sqrt(64)
    clean, _, _ = _step(impl, config, q, k, v, table, lens, store, sigma)
    position = 5 * config.page_size + 3  # an indexed page of request 0 (300 tokens: pages 1..16)
    slot = int(table[0, position // config.page_size]) * config.page_size + position % config.page_size
    k[slot, 1, 7] = bad
    store.build_pages(k, torch.tensor([slot // config.page_size]))
    out, stats, masks = _step(impl, config, q, k, v, table, lens, store, sigma)
    # the query heads of KV head 1 attend it, except where its score is -inf (no softmax mass)
    scores = q[0, 3:6].double() @ k[slot, 1].double()
    assert bool((masks[0][3:6, position] | (scores == -math.inf)).all())
    torch.testing.assert_close(out[1:], clean[1:], atol=0, rtol=0)


def test_unsupported_options_are_refused_naming_option_and_implementation():
    clustered = LouverConfig(family="clustered", n_subspaces=8)
    for impl in (i for i in IMPLS if i != "torch"):
        with pytest.raises(ValueError, match=f"family='clustered' is not supported by the '{impl}'"):
            LouverDecode(clustered, "cpu", impl=impl)
    with pytest.raises(ValueError, match="unknown decode implementation 'cuda'"):
        LouverDecode(LouverConfig(), "cpu", impl="cuda")
    assert LouverDecode(clustered, "cpu").impl_name == "torch"  # auto: what honours the config
