"""The compiled CPU step's certified histogram rule in one scan of the codes (``CpuLaunch.one_scan``):
the pass that builds the histogram keeps every token reaching the reserve level, and the attend
pass reads that reserve at T. It must be the two-scan step: the same T, the same attended set and
counters, the same certificate up to the histogram's fp64 rounding, the same output. Requests whose
T lies below their reserve level (forced here with a reserve level far above the safe one) take the
two scans, beside requests that do not.

(The conformance suite runs the default, one scan, through the contract on every layout: recall
1.0 against fp64, dropped mass within the bound, bound below eps.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from conftest import compiled_attended, make_paged, needs_impl
from louver_sgl import LouverConfig, PageIndexStore
from louver_sgl.decode import LouverDecode

LENS = [1500, 700, 129, 2000]
SIGMA = 1 / math.sqrt(64)


def _case(dtype=torch.float32, seed=0, page_size=16, bits=8, groups=3, eps=1e-2, dim=64):
    config = LouverConfig(page_size=page_size, grid_bits=bits, policy="certified", eps=eps, sample_size=32)
    k, v, table, lens = make_paged(LENS, page_size, 2, dim, seed=seed, dtype=dtype)
    store = PageIndexStore(config, len(k) // page_size, 2, dim, dtype)
    store.build_pages(k, torch.arange(store.num_pages))
    q = (torch.randn(len(LENS), 2 * groups, dim, generator=torch.Generator().manual_seed(seed + 1)) * 2).to(dtype)
    return config, q, k, v, table, lens, store


def _step(config, q, k, v, table, lens, store, **launch):
    decode = LouverDecode(config, "cpu", impl="cpu", launch={"chunk_pages": 3, **launch}).plan(table, lens)
    result = decode.run(q, k, v, store, SIGMA, stats=True, attended=True)
    return Step(result.out, result.stats, result.attended, _paged_requests(decode.current_plan))


@dataclass
class Step:
    out: torch.Tensor
    stats: object
    attended: list
    paged_requests: set  # requests whose attend pass opened pages (_paged_requests)


def _paged_requests(plan) -> set[int]:
    """The requests whose attend pass opened pages (the two scans' second); the one-scan attend
    pass reads the reserve and opens none. From the step's chunk counters (plan side buffers)."""
    from louver_sgl.decode.impl_cpu import page_chunks

    (part, _, _), = [side for key, side in plan.derived.items() if key[0] == "cpu_step"]
    chunk_req = page_chunks(plan, 3)[0]
    opened = part.counts[..., -1].sum(1)  # [NC]: pages read per chunk
    return {int(b) for b in chunk_req[opened > 0]}


def _same_step(one, two, pages_read_too=True):
    s1, s2 = one.stats, two.stats
    assert torch.equal(s1.threshold, s2.threshold)
    torch.testing.assert_close(s1.mass_bound, s2.mass_bound, rtol=1e-9, atol=0)
    for name in ("candidates", "pages_skipped", "union_candidates", "values_read", "dense_fallback"):
        assert torch.equal(getattr(s1, name), getattr(s2, name)), name
    if pages_read_too:
        assert torch.equal(s1.pages_read, s2.pages_read)
    for m1, m2 in zip(one.attended, two.attended):
        assert torch.equal(m1, m2)
    torch.testing.assert_close(one.out, two.out, rtol=0, atol=1e-5 if one.out.dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("page_size,groups,dim", [(16, 3, 64), (32, 4, 64), (16, 1, 64), (8, 3, 64), (16, 3, 96)],
                         ids=["p16-g3", "p32-g4", "p16-g1", "p8-tokens", "d96-no-vnni"])
@pytest.mark.parametrize("eps", [1e-2, 1e-4])
def test_one_scan_is_the_two_scan_step(dtype, page_size, groups, dim, eps):
    """8-bit codes (the one-scan step's): 16-token VNNI blocks, the per-token path (pages of 8)
    and the plain one (D = 96)."""
    needs_impl("cpu")
    case = _case(dtype, page_size=page_size, groups=groups, eps=eps, dim=dim)
    one, two = _step(*case), _step(*case, one_scan=False)
    assert one.paged_requests == set()  # no request took the two scans
    # pages read: the scan reads every page some head keeps at its reserve level, the second
    # scan only those kept at T
    _same_step(one, two, pages_read_too=False)
    assert bool((one.stats.pages_read >= two.stats.pages_read).all())
    assert bool((one.stats.mass_bound < case[0].eps).all())


def test_the_attended_set_is_the_bounds_set_at_its_own_t():
    """Recall and its converse: the keys the one-scan step attended are exactly those its int8
    bounds keep at its T (its reserve lost none and added none)."""
    needs_impl("cpu")
    config, q, k, v, table, lens, store = _case(seed=3)
    one = _step(config, q, k, v, table, lens, store)
    spec = compiled_attended(q, k, table, lens, store, one.stats.threshold, kernel_bounds=True)
    for b, mask in enumerate(one.attended):
        assert torch.equal(mask, spec[b]), f"request {b}: attended set differs from its specification"


@pytest.mark.parametrize("offset", [9, 10, 256])
def test_requests_below_their_reserve_level_take_the_two_scans(offset):
    """A reserve level ``offset`` edges above the safe level: heads whose rule's edge lies below it
    lack tokens in the reserve, and their requests take the two scans; every request's step is still
    the two-scan step's (at 256 every request falls back, at 9 and 10 some, under the int8 weights'
    rule of either build: ±127, or AVX2's lane groups)."""
    needs_impl("cpu")
    case = _case(seed=5, eps=1e-2)
    one, two = _step(*case, reserve_offset=offset), _step(*case, one_scan=False)
    _same_step(one, two, pages_read_too=offset == 256)
    everyone = set(range(len(LENS)))
    assert two.paged_requests == everyone
    assert one.paged_requests == everyone if offset == 256 else 0 < len(one.paged_requests) < len(LENS)
    assert _step(*case).paged_requests == set()  # the default level: no request takes the two scans


def test_a_nan_key_keeps_the_contract():
    """A NaN in a dense key makes ref or Z_lb of its heads NaN: no safe level, every token of the
    request in the reserve (T = −inf keeps them all); an indexed NaN key is a candidate for every
    head. Both as the two-scan step."""
    needs_impl("cpu")
    config, q, k, v, table, lens, store = _case(seed=7)
    bad = k.clone()
    tail = int(lens[0]) - 1
    bad[int(table[0, tail // 16]) * 16 + tail % 16, 1, 5] = float("nan")
    bad[int(table[3, 40]) * 16 + 3, 0, 7] = float("nan")
    store.build_pages(bad, torch.arange(store.num_pages))
    one, two = _step(config, q, bad, v, table, lens, store), _step(config, q, bad, v, table, lens, store, one_scan=False)
    assert torch.equal(one.stats.threshold.isnan(), two.stats.threshold.isnan())
    s1, s2 = one.stats, two.stats
    assert torch.equal(s1.threshold.nan_to_num(0.0), s2.threshold.nan_to_num(0.0))
    for m1, m2 in zip(one.attended, two.attended):
        assert torch.equal(m1, m2)
    torch.testing.assert_close(one.out, two.out, rtol=0, atol=1e-5, equal_nan=True)


def test_four_bit_codes_keep_the_two_scans():
    """With 4-bit codes the step keeps its two scans (CpuLaunch.one_scan applies to 8-bit codes):
    every request's attend pass opens pages."""
    needs_impl("cpu")
    case = _case(bits=4)
    assert _step(*case).paged_requests == set(range(len(LENS)))


def test_launch_values_are_checked():
    from louver_sgl.decode.impl_cpu import CpuLaunch

    with pytest.raises(ValueError, match="one_scan must be a bool"):
        CpuLaunch(one_scan=1)
    with pytest.raises(ValueError, match="reserve_offset must be an int"):
        CpuLaunch(reserve_offset=1000)
    with pytest.raises(ValueError, match="unknown CPU launch parameters"):
        CpuLaunch.of({"one_scans": True})


@pytest.mark.parametrize("policy", ["certified", "certified-one-pass", "certified-a-posteriori", "budget", "fixed"])
@pytest.mark.parametrize("one_scan", [True, False], ids=["one-scan", "two-scans"])
def test_residual_weights_keep_the_contract(policy, one_scan):
    """Residual int8 weights (``CpuLaunch.residual_weights``) on every policy's compiled step: the
    conformance suite's checks (recall 1.0 against fp64, dropped mass within the bound, the output
    fp64 attention over the attended set, counts), and the attended set is the residual bounds' set
    at the step's T."""
    needs_impl("cpu")
    from test_decode_conformance import LAYOUTS, _case as conformance_case, _check_step

    for layout in LAYOUTS:
        config, q, k, v, table, lens, store = conformance_case("cpu", policy, layout, torch.float16)
        decode = LouverDecode(config, "cpu", impl="cpu",
                              launch={"chunk_pages": 3, "residual_weights": True, "one_scan": one_scan})
        result = decode.plan(table, lens).run(q, k, v, store, SIGMA, attended=True)
        _check_step(config, q, k, v, table, lens, store, SIGMA, result.out, result.stats, result.attended)
        if policy == "certified" and layout[0] == "p16-gqa3":  # no value gate: the bounds' set
            spec = compiled_attended(q, k, table, lens, store, result.stats.threshold, kernel_bounds=True,
                                     residual=True)
            for b, mask in enumerate(result.attended):
                if not bool(result.stats.dense_fallback[b]):
                    assert torch.equal(mask, spec[b]), f"request {b}: attended set differs"


def test_residual_weights_keep_fewer_keys():
    """On the same batch the residual bounds keep no more keys than the int8 ones, and at least as
    many as the store's fp32 bounds can (the torch implementation: within fp32 rounding of them)."""
    needs_impl("cpu")
    config, q, k, v, table, lens, store = _case(seed=2, bits=8)
    kept = {}
    for name, impl, launch in (("int8", "cpu", {"residual_weights": False}), ("residual", "cpu", {"residual_weights": True}),
                               ("fp32", "torch", None)):
        decode = LouverDecode(config, "cpu", impl=impl, launch=launch).plan(table, lens)
        kept[name] = int(decode.run(q, k, v, store, SIGMA, stats=True).stats.candidates.sum())
    assert kept["residual"] < kept["int8"]
    assert abs(kept["residual"] - kept["fp32"]) <= 0.01 * kept["fp32"]
