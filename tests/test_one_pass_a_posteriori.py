"""The one-pass rule a posteriori (``certified_passes=1``, ``certified_rule="a_posteriori"``): the
provisional level is the safe level at the estimate Z_est, the check divides by Z_att, and a head
whose check fails is lowered to the safe level at Z_att; the torch and compiled CPU steps follow
the reference.

(The conformance suite runs the option through every implementation's contract: recall 1.0,
measured dropped mass below the bound, bound below eps.)
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import compiled_attended, fp64_request, implementations_here, make_paged, needs_impl
from louver_sgl import LouverConfig, PageIndexStore
from louver_sgl.decode import LouverDecode
from louver_sgl.decode.plan import _sample_positions, split_pages
from louver_sgl.decode.reference import reference_decode

LENS = [1500, 700, 129]
SIGMA = 1 / math.sqrt(64)
CONFIG = LouverConfig(page_size=16, policy="certified", eps=1e-2, certified_passes=1, certified_rule="a_posteriori",
                      sample_size=32, dense_fallback_fraction=1.0)


def _case(config=CONFIG, seed=0):
    k, v, table, lens = make_paged(LENS, 16, 2, 64, seed=seed)
    q = torch.randn(len(LENS), 6, 64, generator=torch.Generator().manual_seed(seed + 1)) * 2
    return config, q, k, v, table, lens


def _store(config, k):
    store = PageIndexStore(config, len(k) // 16, 2, 64, k.dtype)
    store.build_pages(k, torch.arange(store.num_pages))
    return store


def _step(impl, config, q, k, v, table, lens, store, attended=False):
    launch = {"chunk_pages": 3} if impl == "cpu" else None
    decode = LouverDecode(config, "cpu", impl=impl, launch=launch).plan(table, lens)
    return decode.run(q, k, v, store, SIGMA, stats=True, attended=attended)


def _adversarial(k, q, table, lens, config, b=0, kv_heads=slice(None)):
    """Request b's keys rewritten so that the estimate overshoots Z: its sampled indexed keys score
    40 (the reference score), every other key 0. Z_est ~ 4·n while Z ~ 32 (the sample), so the
    safe level at Z_est (~14) drops every unsampled indexed key, whose mass (n·e^{−40σ} ~ 10) is
    far above eps·Z_att (~0.3): the check fails."""
    k, q = k.clone(), q.clone()
    q[b] = 0.0
    q[b, :, 0] = 4.0
    n = int(lens[b])
    pos = torch.arange(n)
    slots = table[b, pos // config.page_size] * config.page_size + pos % config.page_size
    k[slots] = torch.randn(n, k.shape[1], k.shape[2], generator=torch.Generator().manual_seed(3))
    k[slots, :, 0] = 0.0  # score 0 for every key of the request
    _, indexed, _ = split_pages(n, config)
    idx = torch.arange(indexed.start * config.page_size, indexed.stop * config.page_size)
    sampled = idx[_sample_positions(len(idx), config.sample_size)]
    k[slots[sampled], kv_heads, 0] = 10.0  # score 40 (for the query heads of ``kv_heads``)
    return k, q


@pytest.mark.parametrize("seed", [0, 5])
def test_torch_step_equals_the_reference(seed):
    """Same T per head as the reference, the same attended set, the certificate below eps."""
    config, q, k, v, table, lens = _case(seed=seed)
    store = _store(config, k)
    _, info = reference_decode(q, k, v, table, lens, store, SIGMA)
    step = _step("torch", config, q, k, v, table, lens, store, attended=True)
    for b in range(len(LENS)):
        torch.testing.assert_close(step.stats.threshold[b], info[b]["threshold"], rtol=1e-5, atol=1e-4)
        assert torch.equal(step.attended[b], info[b]["attended"])
    assert bool((step.stats.mass_bound < config.eps).all())


def test_the_estimate_keeps_fewer_keys_than_the_safe_level_at_z_lb():
    """Where the check passes, T_p at Z_est ≥ Z_lb is at or above the one-pass rule's T_p at Z_lb
    (strictly above on these keys), so no head keeps more candidates."""
    config, q, k, v, table, lens = _case()
    store = _store(config, k)
    est = _step("torch", config, q, k, v, table, lens, store).stats
    lb = _step("torch", config.with_(certified_rule="histogram"), q, k, v, table, lens, store).stats
    assert bool((est.threshold >= lb.threshold).all()) and bool((est.threshold > lb.threshold).any())
    assert bool((est.candidates <= lb.candidates).all()) and int(est.candidates.sum()) < int(lb.candidates.sum())


def test_compiled_step_takes_the_reference_level():
    """The compiled step's T is the reference's in most heads (the provisional level at Z_est, or
    the safe level at Z_att where the check failed); a head can differ where the two checks
    disagree, since each sums its own bounds (int8 against fp32: a looser dropped mass, and a
    larger candidate union in Z_att). It certifies below eps and attends its int8 bounds' set at
    its T, with the counters of that set."""
    needs_impl("cpu")
    config, q, k, v, table, lens = _case(seed=4)
    store = _store(config, k)
    _, info = reference_decode(q, k, v, table, lens, store, SIGMA)
    step = _step("cpu", config, q, k, v, table, lens, store, attended=True)
    ref_t = torch.stack([i["threshold"] for i in info])
    # the compiled Z_dense and Z_sample are fp32-exp lower bounds (kMassDown) with the scores
    # lowered by a magnitude slack where the reference lowers them by a norm slack: T moves by a
    # few 1e-3 (ln of their ratio over σ), while a wrong term of the level (n, M, the share) moves
    # it by ln(2)/σ = 5.5 or more
    same = (step.stats.threshold - ref_t).abs() <= 2e-2
    assert int(same.sum()) >= 2 * same.numel() // 3, f"{int(same.sum())} of {same.numel()} heads at the reference's T"
    assert bool((step.stats.mass_bound < config.eps).all())
    spec = compiled_attended(q, k, table, lens, store, step.stats.threshold)
    for b, mask in enumerate(step.attended):
        assert torch.equal(mask, spec[b]), f"request {b}: attended set differs from its specification"
        counted = mask.sum(1) - (int(lens[b]) - int(step.stats.num_indexed[b]))
        assert torch.equal(counted, step.stats.candidates[b]), "counts differ from the attended set"


@pytest.mark.parametrize("impl", [i for i in ("torch", "cpu") if i in implementations_here("cpu")])
def test_a_failed_check_lowers_the_head_to_the_safe_level_at_z_att(impl):
    """Request 0's keys make the estimate overshoot (``_adversarial``): every head's check fails
    with finite terms, so each is lowered from the provisional level (~14) to the safe level at
    Z_att (~−27: every key kept), as in the reference; recall is 1.0 and the dropped mass below
    eps against an fp64 brute force; the compiled step attends its bounds' set at its own T; the
    other requests keep their levels."""
    config, q, k, v, table, lens = _case(seed=2)
    k, q = _adversarial(k, q, table, lens, config)
    store = _store(config, k)
    step = _step(impl, config, q, k, v, table, lens, store, attended=True)
    _, info = reference_decode(q, k, v, table, lens, store, SIGMA)
    torch.testing.assert_close(step.stats.threshold[0], info[0]["threshold"], rtol=0, atol=2e-2)
    assert bool((step.stats.threshold[0] < -20.0).all()) and bool(step.stats.lowered[0].all())
    if impl == "torch":
        assert torch.equal(step.attended[0], info[0]["attended"])
    else:
        spec = compiled_attended(q, k, table, lens, store, step.stats.threshold)
        assert all(torch.equal(mask, spec[b]) for b, mask in enumerate(step.attended))
    alone = _step(impl, config, q[1:], k, v, table[1:], lens[1:], store)
    assert torch.equal(step.stats.threshold[1:], alone.stats.threshold)
    for b in range(len(LENS)):
        scores, _ = fp64_request(q, k, v, table, lens, b, 16)
        p = torch.softmax(SIGMA * scores, dim=1)
        assert float((p * ~step.attended[b]).sum(1).max()) <= config.eps
        assert not bool(((scores >= step.stats.threshold[b, :, None].double()) & ~step.attended[b]).any())
    assert bool((step.stats.mass_bound < config.eps).all())


@pytest.mark.parametrize("impl", [i for i in ("torch", "cpu") if i in implementations_here("cpu")])
def test_lowered_heads_beside_passing_ones(impl):
    """``_adversarial`` on KV head 0 only: request 0's first group fails its check and is lowered,
    its second group keeps the provisional level (its keys all score 0: every key kept), as in the
    reference; the contract holds for every request (recall 1.0, dropped mass below its bound and
    eps against an fp64 brute force, the compiled step's attended set its bounds' set at its T and
    its counters those of that set)."""
    config, q, k, v, table, lens = _case(seed=3)
    k, q = _adversarial(k, q, table, lens, config, kv_heads=0)
    store = _store(config, k)
    step = _step(impl, config, q, k, v, table, lens, store, attended=True)
    _, info = reference_decode(q, k, v, table, lens, store, SIGMA)
    # request 0's checks pass or fail by far (random requests can sit at the budget, where the
    # compiled and fp32 bounds' checks may disagree: test_compiled_step_takes_the_reference_level)
    torch.testing.assert_close(step.stats.threshold[0], info[0]["threshold"], rtol=0, atol=2e-2)
    assert bool((step.stats.threshold[0, :3] < -20.0).all())  # lowered from ~14
    assert step.stats.lowered[0].tolist() == [True] * 3 + [False] * 3
    spec = compiled_attended(q, k, table, lens, store, step.stats.threshold) if impl == "cpu" else None
    for b in range(len(LENS)):
        assert torch.equal(step.attended[b], spec[b] if spec is not None else info[b]["attended"])
        counted = step.attended[b].sum(1) - (int(lens[b]) - int(step.stats.num_indexed[b]))
        assert torch.equal(counted, step.stats.candidates[b])
        scores, values = fp64_request(q, k, v, table, lens, b, 16)
        dropped = (torch.softmax(SIGMA * scores, dim=1) * ~step.attended[b]).sum(1)
        assert bool((dropped <= step.stats.mass_bound[b].double() * (1 + 1e-6)).all())
        assert not bool(((scores >= step.stats.threshold[b, :, None].double()) & ~step.attended[b]).any())
        # the output is attention over that set: the lowered group's (attended again) and the passing
        # group's (the compiled step keeps its first pass's state) alike
        p = torch.softmax((SIGMA * scores).masked_fill(~step.attended[b], float("-inf")), dim=1)
        torch.testing.assert_close(step.out[b].double(), torch.einsum("hl,lhd->hd", p, values), rtol=1e-4, atol=1e-5)
    assert bool((step.stats.mass_bound < config.eps).all())


@pytest.mark.parametrize("impl", [i for i in ("torch", "cpu") if i in implementations_here("cpu")])
def test_a_share_per_request_is_that_requests_config_share(impl):
    """``estimate_share`` [B] runs each request as a config with its share would (the same checks
    and levels as the request alone under that config, up to the summation order of Z_att); shares
    above the config's cap of 8 run too and certify (recall 1.0 and the dropped mass below eps
    against fp64)."""
    config, q, k, v, table, lens = _case(seed=4)
    store = _store(config, k)
    shares = torch.tensor([1.0, 6.0, 24.0], dtype=torch.float64)
    launch = {"chunk_pages": 3} if impl == "cpu" else None
    decode = LouverDecode(config, "cpu", impl=impl, launch=launch).plan(table, lens)
    step = decode.run(q, k, v, store, SIGMA, stats=True, attended=True, estimate_share=shares)
    for b, share in enumerate(shares.tolist()):
        if share <= 8.0:
            alone = _step(impl, config.with_(estimate_share=share), q[b:b + 1], k, v, table[b:b + 1], lens[b:b + 1],
                          store)
            # a lowered head's level divides by Z_att, whose sums run over other chunks alone
            lowered = step.stats.lowered[b]
            assert torch.equal(lowered, alone.stats.lowered[0])
            assert torch.equal(step.stats.threshold[b][~lowered], alone.stats.threshold[0][~lowered])
            torch.testing.assert_close(step.stats.threshold[b], alone.stats.threshold[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(step.out[b], alone.out[0], rtol=1e-4, atol=1e-5)
        scores, _ = fp64_request(q, k, v, table, lens, b, 16)
        dropped = (torch.softmax(SIGMA * scores, dim=1) * ~step.attended[b]).sum(1)
        assert bool((dropped <= config.eps).all())
        assert not bool(((scores >= step.stats.threshold[b, :, None].double()) & ~step.attended[b]).any())
    assert bool((step.stats.mass_bound < config.eps).all())
    # where request 2's check passed at share 24, its level is at or above its level at share 1
    low = decode.run(q, k, v, store, SIGMA, stats=True, estimate_share=torch.ones(3, dtype=torch.float64))
    passed = ~step.stats.lowered[2]
    assert bool((step.stats.threshold[2][passed] >= low.stats.threshold[2][passed]).all())


@pytest.mark.parametrize("shares, message", [
    (torch.tensor([1.0, 2.0], dtype=torch.float64), r"\[B\] = \[3\]"),
    (torch.tensor([1.0, 2.0, 3.0]), "float64"),
    (torch.tensor([1.0, 0.0, 3.0], dtype=torch.float64), "positive and finite"),
    (torch.tensor([1.0, float("inf"), 3.0], dtype=torch.float64), "positive and finite"),
    ([1.0, 2.0, 3.0], "float64"),
])
def test_a_share_per_request_is_checked(shares, message):
    """The wrapper checks the tensor, each implementation its values (the compiled one in its kernel)."""
    config, q, k, v, table, lens = _case()
    store = _store(config, k)
    for impl in [i for i in ("torch", "cpu") if i in implementations_here("cpu")]:
        decode = LouverDecode(config, "cpu", impl=impl).plan(table, lens)
        kernel_says = message == "positive and finite" and impl == "cpu"
        with pytest.raises(ValueError, match="is not a positive finite number" if kernel_says else message):
            decode.run(q, k, v, store, SIGMA, estimate_share=shares)


def test_a_share_per_request_needs_the_a_posteriori_rule_and_an_implementation_that_takes_it():
    config, q, k, v, table, lens = _case()
    store = _store(config, k)
    ones = torch.ones(3, dtype=torch.float64)
    histogram = LouverDecode(config.with_(certified_rule="histogram"), "cpu", impl="torch").plan(table, lens)
    with pytest.raises(ValueError, match="for certified_rule='a_posteriori'"):
        histogram.run(q, k, v, store, SIGMA, estimate_share=ones)
    decode = LouverDecode(config, "cpu", impl="torch").plan(table, lens)
    decode.impl.takes_shares = False
    with pytest.raises(ValueError, match="takes no estimate share per request"):
        decode.run(q, k, v, store, SIGMA, estimate_share=ones)
