"""The one-pass certified rule (``certified_passes=1``): the provisional level always certifies,
and the torch and compiled CPU steps follow the reference's rule.

(The conformance suite runs the option through every implementation's contract: recall 1.0,
measured dropped mass below the bound, bound below eps.)
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import compiled_attended, implementations_here, make_paged, needs_impl
from louver_sgl import LouverConfig, PageIndexStore
from louver_sgl.decode import LouverDecode
from louver_sgl.decode import threshold as th
from louver_sgl.decode.reference import reference_decode

LENS = [1500, 700, 129]


@pytest.mark.parametrize("seed", range(20))
def test_the_provisional_level_always_fits(seed):
    """Random page and token bounds, references and masses: the mass dropped at the safe level
    (pages below it whole, other tokens below it) always passes the check."""
    gen = torch.Generator().manual_seed(seed)
    pages, size, heads = int(torch.randint(1, 60, (1,), generator=gen)), 16, 4
    scale = float(torch.empty(1).uniform_(0.1, 30, generator=gen))
    tok = torch.randn(pages, size, heads, generator=gen) * scale
    pb = tok.amax(1) + torch.rand(pages, heads, generator=gen) * scale
    ref = (pb.amax(0) * torch.empty(heads).uniform_(0.5, 1.5, generator=gen))[None]
    z_lb = torch.empty(1, heads, dtype=torch.float64).uniform_(1.0, 50.0, generator=gen)
    sigma, eps = 0.125, float(10 ** torch.empty(1).uniform_(-6, -1, generator=gen))
    t = th.safe_level(ref, z_lb, torch.tensor([pages * size]), sigma, eps * th.BUDGET_SAFETY, th.HIST_ROUNDING)[0]
    skip = pb < t
    x_page, x_tok = th.log_mass(pb, ref, sigma), th.log_mass(torch.minimum(tok, pb[:, None]), ref, sigma)
    dropped = (torch.where(skip, size * torch.exp(x_page), 0.0).sum(0)
               + torch.where(~skip[:, None] & (tok < t), torch.exp(x_tok), 0.0).sum((0, 1)))
    ok, cert = th.provisional_certified(dropped[None], z_lb, eps * th.BUDGET_SAFETY, th.HIST_ROUNDING)
    assert bool(ok.all()) and bool((cert < eps * z_lb).all())


def test_the_check_fails_on_non_finite_terms():
    ok, _ = th.provisional_certified(torch.tensor([[0.0, math.nan]], dtype=torch.float64),
                                     torch.tensor([[1.0, 1.0]], dtype=torch.float64), 1e-3, 1e-8)
    assert ok.tolist() == [[True, False]]
    t = th.safe_level(torch.tensor([[math.nan, 1.0], [1.0, 1.0]]), torch.ones(2, 2, dtype=torch.float64),
                      torch.tensor([64, 0]), 0.125, 1e-3, 1e-8)
    assert t[0, 0] == -math.inf and bool((t[1] == -math.inf).all())  # NaN ref; nothing indexed
    assert math.isfinite(float(t[0, 1]))


def _case(dtype=torch.float32, seed=0):
    config = LouverConfig(page_size=16, policy="certified", eps=1e-2, certified_passes=1, sample_size=32,
                          dense_fallback_fraction=1.0)
    k, v, table, lens = make_paged(LENS, 16, 2, 64, seed=seed, dtype=dtype)
    store = PageIndexStore(config, len(k) // 16, 2, 64, dtype)
    store.build_pages(k, torch.arange(store.num_pages))
    q = (torch.randn(len(LENS), 6, 64, generator=torch.Generator().manual_seed(seed + 1)) * 2).to(dtype)
    return config, q, k, v, table, lens, store


def test_torch_step_equals_the_reference():
    """Same provisional T per head as the reference, the same attended set, the certificate below eps."""
    config, q, k, v, table, lens, store = _case()
    sigma = 1 / math.sqrt(64)
    _, info = reference_decode(q, k, v, table, lens, store, sigma)
    decode = LouverDecode(config, "cpu", impl="torch").plan(table, lens)
    step_result = decode.run(q, k, v, store, sigma, attended=True)
    stats, masks = step_result.stats, step_result.attended
    for b in range(len(LENS)):
        # T moves with ref and Z_lb, whose fp32 scores the two compute in different orders
        torch.testing.assert_close(stats.threshold[b], info[b]["threshold"], rtol=1e-5, atol=1e-4)
        assert torch.equal(masks[b], info[b]["attended"])
    assert bool((stats.mass_bound < config.eps).all())


def test_compiled_step_takes_the_provisional_level():
    """The compiled step's T is the reference's provisional level (its exact part's ref and Z_lb
    match to rounding) and it certifies below eps in the one pass; its counters are those of the
    attended set its int8 bounds give at that T; the two-pass step on the same batch certifies too."""
    needs_impl("cpu")
    config, q, k, v, table, lens, store = _case(seed=4)
    sigma = 1 / math.sqrt(64)
    _, info = reference_decode(q, k, v, table, lens, store, sigma)
    one = LouverDecode(config, "cpu", impl="cpu", launch={"chunk_pages": 3}).plan(table, lens)
    step_result = one.run(q, k, v, store, sigma, attended=True)
    stats, masks = step_result.stats, step_result.attended
    for b in range(len(LENS)):
        # the compiled exact part's Z_lb is its fp32-exp lower bound (kMassDown), a little below the
        # fp64 sum: T sits lower by ln(that factor)/σ, far inside this tolerance, while a wrong
        # term of the level (n, eps, the rounding factor) would move it by ln(2)/σ or more
        torch.testing.assert_close(stats.threshold[b], info[b]["threshold"], rtol=0, atol=1e-3)
    assert bool((stats.mass_bound < config.eps).all())
    spec = compiled_attended(q, k, table, lens, store, stats.threshold)
    for b, mask in enumerate(masks):  # the set the kernel attended: its bounds' set at its own T
        assert torch.equal(mask, spec[b]), f"request {b}: attended set differs from its specification"
        counted = mask.sum(1) - (int(lens[b]) - int(stats.num_indexed[b]))
        assert torch.equal(counted, stats.candidates[b]), "counts differ from the attended set"
    two = LouverDecode(config.with_(certified_passes=2), "cpu", impl="cpu", launch={"chunk_pages": 3}).plan(table, lens)
    stats2 = two.run(q, k, v, store, sigma, stats=True).stats
    assert bool((stats2.mass_bound < config.eps).all())


@pytest.mark.parametrize("impl", [i for i in ("torch", "cpu") if i in implementations_here("cpu")])
def test_a_failed_check_takes_the_histogram_rule_for_that_request_only(impl):
    """A NaN in a dense key of request 0 makes Z_lb NaN for its KV group's heads, so their check
    fails: request 0 takes the histogram rule (its T and certificate equal the two-pass step's),
    and every other request keeps its one-pass T and output."""
    config, q, k, v, table, lens, store = _case(seed=7)
    sigma = 1 / math.sqrt(64)
    launch = {"chunk_pages": 3} if impl == "cpu" else None

    def step(cfg, keys):
        decode = LouverDecode(cfg, "cpu", impl=impl, launch=launch).plan(table, lens)
        step_result = decode.run(q, keys, v, store, sigma, stats=True)
        return step_result.out, step_result.stats

    clean_out, clean = step(config, k)
    bad = k.clone()
    tail = int(lens[0]) - 1  # the last token of request 0: in its dense tail
    bad[int(table[0, tail // 16]) * 16 + tail % 16, 1, 5] = float("nan")
    out, stats = step(config, bad)
    _, two = step(config.with_(certified_passes=2), bad)
    torch.testing.assert_close(stats.threshold[0], two.threshold[0], atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(stats.mass_bound[0], two.mass_bound[0], atol=0, rtol=0, equal_nan=True)
    assert torch.equal(stats.threshold[1:], clean.threshold[1:]) and torch.equal(out[1:], clean_out[1:])
    assert not torch.equal(stats.threshold[0], clean.threshold[0])
