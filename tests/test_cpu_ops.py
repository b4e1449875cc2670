"""The compiled CPU steps around the attend kernel against their torch specifications."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import cancelling_batch, make_paged, needs_impl
from louver_sgl import LouverConfig
from louver_sgl.decode import threshold as th
from louver_sgl.decode.contract import EDGES, VALUE_GATE, StepStats
from louver_sgl.decode.impl_cpu import compiled_exact_part, compiled_ops
from louver_sgl.decode.impl_torch import exact_part
from louver_sgl.decode.plan import plan_decode
from louver_sgl.decode.reference_compiled import (
    Int8Rule, chunk_totals_reference, int8_token_bounds_reference, lane_group_sums, merge_reference,
    step_stats_reference,
)
from louver_sgl.decode.threshold import certified_choice as certified_threshold_reference

OPS = compiled_ops()
if OPS is None:
    needs_impl("cpu")  # skips the module, or on CI fails it with the compiler's message
LENS = [300, 700, 20, 64, 129, 1]


def _batch(dtype, groups=3, h_kv=2, dim=64, sample_size=40):
    cfg = LouverConfig(page_size=16, sample_size=sample_size)
    k, v, table, lens = make_paged(LENS, 16, h_kv, dim, seed=7, dtype=dtype)
    q = torch.randn(len(LENS), h_kv * groups, dim, generator=torch.Generator().manual_seed(8)) * 2
    return q, k, v, plan_decode(table, lens, cfg), cfg


def _true_mass(q, k, slots, req, ref, sigma):
    """fp64 Σ exp(σ(q·k − ref)) over rows (slots, req) per (request, head) ``[B, H_q]``."""
    b, heads, dim = q.shape
    h_kv = k.shape[1]
    rows = q.double().view(b, h_kv, heads // h_kv, dim)[req]
    s = torch.einsum("nkd,nkgd->nkg", k[slots].double(), rows).reshape(len(slots), heads)
    out = torch.zeros(b, heads, dtype=torch.float64)
    return out.index_add_(0, req, torch.exp(sigma * (s - ref.double()[req])))


@pytest.mark.parametrize("impl", ["torch", "cpu"])
def test_exact_part_masses_bound_the_true_keys_mass(impl):
    """Z_lb is a lower bound of the exactly scored keys' true mass although their fp32 scores err
    (each part's scores lowered by their slack), and not a vacuous one."""
    q, k, _, table, lens = cancelling_batch([300, 700, 129, 64])
    cfg = LouverConfig(page_size=16, sample_size=40)
    plan, sigma = plan_decode(table, lens, cfg), 0.125
    ex = exact_part(q, k, plan, sigma) if impl == "torch" else compiled_exact_part(q, k, plan, sigma, 40, OPS)[0]
    dense = _true_mass(q, k, plan.dense_slots, plan.dense_req, ex.ref, sigma)
    total = dense + _true_mass(q, k, plan.sample_slots, plan.sample_req, ex.ref, sigma)
    assert bool((ex.z_dense <= dense).all()) and bool((ex.z_lb <= total).all())
    assert bool((ex.z_lb >= 0.5 * total).all())


def test_attend_pass_candidate_mass_bounds_the_true_keys_mass():
    """The attend pass's union-candidate mass (the a-posteriori rule's Z_att terms) is a lower bound
    of the candidates' true mass although their fp32 scores err: every indexed key is a candidate
    at T = −1e30, so the bound is compared with the true mass of all of them."""
    from louver_sgl import PageIndexStore
    from louver_sgl.decode.impl_cpu import _Outputs, page_chunks

    lens = [300, 700, 129]
    q, k, v, table, lens_t = cancelling_batch(lens)
    cfg = LouverConfig(page_size=16, policy="fixed", sample_size=40)
    plan = plan_decode(table, lens_t, cfg)
    # one indexed key per request and KV head dominates its heads' candidate mass (about e^8 times
    # the rest), so its own fp32 error is not averaged away: along Σ_g q_g/‖q_g‖, 12 times over
    sampled = set(plan.sample_slots.tolist())
    for b in range(len(lens)):
        slot = next(int(s) for s in plan.page_ids[plan.page_req == b] * 16 + 5 if int(s) not in sampled)
        for kv in range(2):
            heads = q[b, 3 * kv:3 * kv + 3]
            k[slot, kv] += 12 * (heads / heads.norm(dim=1, keepdim=True)).sum(0)
    store = PageIndexStore(cfg, len(k) // 16, 2, 64, torch.float32)
    store.build_pages(k, torch.arange(store.num_pages))
    chunks = page_chunks(plan, 3)
    out = _Outputs(len(lens), 6, 2, 64, len(chunks[0]), len(plan.dense_slots), cfg.sample_size)
    plan_tensors = dict(dense_slots=plan.dense_slots, dense_req=plan.dense_req, sample_slots=plan.sample_slots,
                        sample_req=plan.sample_req, page_ids=plan.page_ids, chunk_req=chunks[0],
                        chunk_begin=chunks[1], chunk_end=chunks[2])
    policy = dict(sigma=0.125, budget=-1.0, t_fixed=-1e30, value_gate=False, gate_rel=VALUE_GATE.rel, residual_weights=True,
                  bits=cfg.grid_bits, page_size=16)
    index = {n: store.tensors[n] for n in ("lo", "scale", "radius", "codes")}
    fused = {n: t for n, t in out.named().items() if n not in ("z_lb", "hist", "habs", "certificate")
             and not n.startswith(("band_", "reserve_"))}
    OPS.fused_step(q=q, k_cache=k, v_cache=v, **index, **plan_tensors, **policy, **fused)
    slots = (plan.page_ids[:, None] * 16 + torch.arange(16)).reshape(-1)
    req = plan.page_req.repeat_interleave(16)
    want = _true_mass(q, k, slots, req, out.ref, 0.125)
    got = out.masses[..., 2]
    assert int(out.per_req[:, 0].sum()) == len(slots) * 2  # every indexed key, for both KV heads
    assert bool((got <= want).all()) and bool((got >= 0.5 * want).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_exact_part_matches_torch(dtype):
    q, k, _, plan, cfg = _batch(dtype)
    sigma = 1 / math.sqrt(64)
    want = exact_part(q, k, plan, sigma)
    got, t = compiled_exact_part(q, k, plan, sigma, cfg.sample_size, OPS)
    assert t is None
    torch.testing.assert_close(got.s_dense, want.s_dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.ref, want.ref, atol=1e-5, rtol=1e-5)
    for name in ("z_dense", "z_lb"):  # lower bounds (fp32 exps times kMassDown) within 2^-14 of fp64
        g, w = getattr(got, name), getattr(want, name)
        assert bool((g <= w).all()) and bool((g >= w * (1 - 2**-14)).all()), name
    width = want.sample[0].shape[1]
    torch.testing.assert_close(got.sample[0][:, :width], want.sample[0], atol=1e-5, rtol=1e-5)
    assert bool(torch.isneginf(got.sample[0][:, width:]).all())
    assert torch.equal(got.sample[1], want.sample[1])


@pytest.mark.parametrize("where", ["dense", "sample"])
def test_exact_part_reference_score_propagates_nan(where):
    """A NaN exact score (dense part or sample) makes its head's reference score NaN, as torch's
    amax; the other heads keep the largest score."""
    q, k, _, plan, cfg = _batch(torch.float32)
    slots = plan.dense_slots if where == "dense" else plan.sample_slots
    k[slots[5], 1, :] = float("nan")  # every head of KV head 1 in that row's request
    want = exact_part(q, k, plan, 0.125)
    got, _ = compiled_exact_part(q, k, plan, 0.125, cfg.sample_size, OPS)
    assert bool(want.ref.isnan().any())
    torch.testing.assert_close(got.ref, want.ref, equal_nan=True, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fraction", [0.01, 0.1, 0.5, 1.0])
def test_exact_part_budget_threshold_matches_torch(fraction):
    """The compiled budget T (n-th largest sample score per head) equals threshold.budget_threshold,
    including requests without samples (−inf) and NaN sample scores (ranked above every number)."""
    q, k, _, plan, cfg = _batch(torch.float32)
    k[plan.sample_slots[3], 0, :] = float("nan")  # one NaN score for the heads of KV head 0
    ex, t = compiled_exact_part(q, k, plan, 0.125, cfg.sample_size, OPS, fraction)
    want = th.budget_threshold(ex.sample[0], ex.sample[1], fraction)
    torch.testing.assert_close(t, want, equal_nan=True, atol=0, rtol=0)
    assert bool(torch.isneginf(t[ex.sample[1] == 0]).all())


@pytest.mark.parametrize("sample_size", [7, 40, 300])
@pytest.mark.parametrize("fraction", [0.001, 0.05, 0.3, 1.0])
def test_exact_part_budget_threshold_with_ties_and_infinities(sample_size, fraction):
    """The compiled budget T equals threshold.budget_threshold where most sample scores tie (keys
    and queries of a few small integers, so many scores are equal), some are −inf and some +inf
    (infinite keys), and the samples are longer than a vector of lanes or shorter."""
    gen = torch.Generator().manual_seed(sample_size)
    k, _, table, lens = make_paged(LENS, 16, 2, 64, seed=9, dtype=torch.float32)
    k.copy_(torch.randint(-1, 2, k.shape, generator=gen).float())
    q = torch.randint(-1, 2, (len(LENS), 6, 64), generator=gen).float()
    plan = plan_decode(table, lens, LouverConfig(page_size=16, sample_size=sample_size))
    k[plan.sample_slots[1], 0, :] = float("inf")  # +inf or −inf scores, by the sign of q·1
    k[plan.sample_slots[4], 1, :] = -float("inf")
    ex, t = compiled_exact_part(q, k, plan, 0.125, sample_size, OPS, fraction)
    want = th.budget_threshold(ex.sample[0], ex.sample[1], fraction)
    torch.testing.assert_close(t, want, equal_nan=True, atol=0, rtol=0)


def test_chunk_totals_match_torch():
    gen = torch.Generator().manual_seed(4)
    chunk_req = torch.tensor([0, 0, 1, 3, 3, 3])  # requests 2 and 4 have no chunk
    h_kv, groups, batch = 3, 2, 5
    counts = torch.randint(0, 1000, (len(chunk_req), h_kv, 2 * groups + 3), generator=gen)
    mass = torch.rand(len(chunk_req), h_kv, groups, 3, generator=gen, dtype=torch.float64)
    per_head = torch.full((batch, h_kv * groups, 2), -1, dtype=torch.long)
    per_req = torch.full((batch, 3), -1, dtype=torch.long)
    masses = torch.full((batch, h_kv * groups, 3), -1.0, dtype=torch.float64)
    OPS.chunk_totals(counts=counts, mass=mass, chunk_req=chunk_req, per_head=per_head, per_req=per_req, masses=masses)
    want = chunk_totals_reference(counts, mass, chunk_req, batch)
    assert torch.equal(per_head, want[0]) and torch.equal(per_req, want[1])
    torch.testing.assert_close(masses, want[2], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("own_dropped", [False, True])
def test_step_stats_match_torch(own_dropped):
    gen = torch.Generator().manual_seed(5)
    batch, h_kv, groups = 4, 3, 2
    heads = h_kv * groups
    num_indexed = torch.tensor([1000, 0, 64, 500])
    per_req = torch.stack([torch.tensor([800, 0, 64, 100]), torch.randint(0, 99, (batch,), generator=gen),
                           torch.randint(0, 99, (batch,), generator=gen)], -1)  # requests 0 and 2 fall back
    per_head = torch.randint(0, 500, (batch, heads, 2), generator=gen)
    t = torch.randn(batch, heads, generator=gen)
    z = torch.rand(batch, heads, 2, generator=gen, dtype=torch.float64) + 0.5
    masses = torch.rand(batch, heads, 3, generator=gen, dtype=torch.float64)
    z[3, 1, 0] = float("nan")  # NaN masses stay NaN in the bound, as torch.maximum does
    dropped = torch.rand(batch, heads, generator=gen, dtype=torch.float64) if own_dropped else torch.empty(0, dtype=torch.float64)
    packed, got_any = OPS.step_stats(t=t, z=z, per_head=per_head, per_req=per_req, masses=masses, index_dropped=dropped,
                                     num_indexed=num_indexed, fallback_fraction=0.25, h_kv=h_kv)
    want, want_any = step_stats_reference(t, z, per_head, per_req, masses, dropped, num_indexed, 0.25, h_kv)
    assert got_any is want_any is True
    assert not bool(StepStats.from_packed(packed, num_indexed, num_indexed // 16).lowered.any())  # no checks here
    got = _unpacked(packed, num_indexed)
    assert torch.equal(got[4], torch.tensor([True, False, True, False]))
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, atol=0, rtol=1e-15, equal_nan=True)
    assert bool(torch.isnan(got[3][3, 1])) and float(got[3][0].abs().sum()) == 0.0
    t[0, 0] = 7.0  # the stats own their memory
    assert float(got[0][0, 0]) != 7.0


def _unpacked(packed, num_indexed):
    """step_stats_reference's fields from the packed statistics, through StepStats.from_packed."""
    stats = StepStats.from_packed(packed, num_indexed, num_indexed // 16)
    counts = torch.stack([stats.union_candidates, stats.values_read, stats.pages_read], -1)
    return (stats.threshold, stats.candidates, stats.pages_skipped, stats.mass_bound, stats.dense_fallback, counts)


def test_packed_step_stats_behave_like_a_dataclass():
    """A packed StepStats unpacks once, compares equal to its eager twin and fails on unknown names."""
    packed = torch.arange(2 * 4 * 5, dtype=torch.float64).view(2, 4, 5)
    packed[:, 3, 0] = torch.tensor([1.0, 0.0])
    packed[..., 4] = (torch.arange(8).view(2, 4) % 3 == 0).double()
    lazy = StepStats.from_packed(packed, torch.tensor([64, 32]), torch.tensor([4, 2]))
    # lowered alone leaves the rest packed; the first other field unpacks it once
    assert lazy.lowered.tolist() == [[True, False, False], [False, False, True]] and "_packed" in lazy.__dict__
    eager = StepStats(**{name: getattr(lazy, name) for name in StepStats.__dataclass_fields__})
    assert "_packed" not in lazy.__dict__ and repr(lazy) == repr(eager)
    assert lazy.candidates.dtype == torch.long and lazy.threshold.dtype == torch.float32
    assert lazy.dense_fallback.tolist() == [True, False] and lazy.pages_read.tolist() == [18, 38]
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        lazy.nope


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("given_out", [False, True])
def test_layer_step_is_fused_step_then_step_stats(q_dtype, given_out):
    """The one-call step equals fused_step followed by the statistics' specification, its output
    in q's dtype (new or the caller's buffer, here a strided view), q read through its strides; a
    request over the fallback fraction is flagged."""
    from louver_sgl import PageIndexStore
    from louver_sgl.decode.impl_cpu import _Outputs, page_chunks

    cfg = LouverConfig(page_size=16, policy="budget", budget=0.1, sample_size=40)
    k, v, table, lens = make_paged(LENS, 16, 2, 64, seed=9, dtype=torch.float16)
    q_wide = (torch.randn(len(LENS), 6, 128, generator=torch.Generator().manual_seed(10)) * 2).to(q_dtype)
    q = q_wide[..., 32:96]  # a strided view, as a slice of a fused QKV projection is
    plan = plan_decode(table, lens, cfg)
    store = PageIndexStore(cfg, len(k) // 16, 2, 64, torch.float16)
    store.build_pages(k, torch.arange(store.num_pages))
    index = tuple(store.tensors[n] for n in ("lo", "scale", "radius", "codes"))
    chunks = page_chunks(plan, 3)

    def scratch():
        return _Outputs(len(LENS), 6, 2, 64, len(chunks[0]), len(plan.dense_slots), cfg.sample_size)

    a, b = scratch(), scratch()
    plan_tensors = dict(dense_slots=plan.dense_slots, dense_req=plan.dense_req, sample_slots=plan.sample_slots,
                        sample_req=plan.sample_req, page_ids=plan.page_ids, chunk_req=chunks[0],
                        chunk_begin=chunks[1], chunk_end=chunks[2])
    policy = dict(sigma=0.125, budget=0.1, t_fixed=0.0, value_gate=True, gate_rel=VALUE_GATE.rel, bits=4, page_size=16,
                  residual_weights=True)
    index = dict(zip(("lo", "scale", "radius", "codes"), index))
    fused = {k: v for k, v in a.named().items() if k not in ("z_lb", "hist", "habs", "certificate")
             and not k.startswith(("band_", "reserve_"))}
    OPS.fused_step(q=q.float().contiguous(), k_cache=k, v_cache=v, **index, **plan_tensors, **policy, **fused)
    want, want_any = step_stats_reference(a.t, a.z, *a.totals, torch.empty(0, dtype=torch.float64),
                                          plan.num_indexed, 0.02, 2)
    step_plan = OPS.StepPlan(**plan_tensors, num_indexed=plan.num_indexed, page_req=plan.page_req,
                             q32=torch.empty(len(LENS), 6, 64), **b.named())
    layer = OPS.LayerStep(k_cache=k, v_cache=v, **index, **policy, fallback_fraction=0.02, eps_budget=-1.0,
                          one_pass=False, rounding=0.0, a_posteriori=False, estimate_share=1.0, one_scan=False,
                          reserve_offset=-1, **EDGES.kernel_args())
    out = torch.full((len(LENS), 6, 128), float("nan"), dtype=q_dtype)[..., :64] if given_out else None
    got_out, packed, got_any = layer.run(q, step_plan, out)
    assert got_out.dtype == q_dtype and (not given_out or got_out.data_ptr() == out.data_ptr())
    assert torch.equal(got_out, a.result.to(q_dtype))
    assert got_any is want_any is True  # 2 % of the indexed keys: the long requests fall back
    for g, w in zip(_unpacked(packed, plan.num_indexed), want):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_layer_step_rejects_a_query_that_does_not_fit_the_plan():
    from louver_sgl.decode.impl_cpu import _Outputs, page_chunks

    q, k, v, plan, cfg = _batch(torch.float32)
    chunks = page_chunks(plan, 3)
    part = _Outputs(len(LENS), 6, 2, 64, len(chunks[0]), len(plan.dense_slots), cfg.sample_size)
    step_plan = OPS.StepPlan(dense_slots=plan.dense_slots, dense_req=plan.dense_req, sample_slots=plan.sample_slots,
                             sample_req=plan.sample_req, page_ids=plan.page_ids, chunk_req=chunks[0],
                             chunk_begin=chunks[1], chunk_end=chunks[2], num_indexed=plan.num_indexed,
                             page_req=plan.page_req, q32=torch.empty(len(LENS), 6, 64), **part.named())
    from louver_sgl import PageIndexStore

    store = PageIndexStore(LouverConfig(page_size=16, grid_bits=4), len(k) // 16, 2, 64, torch.float32)
    layer = OPS.LayerStep(k_cache=k, v_cache=v, **{n: store.tensors[n] for n in ("lo", "scale", "radius", "codes")},
                          sigma=0.125, budget=0.1, t_fixed=0.0, value_gate=True, gate_rel=VALUE_GATE.rel, bits=4,
                          page_size=16, fallback_fraction=0.5, eps_budget=-1.0, rounding=0.0, one_pass=False,
                          a_posteriori=False, estimate_share=1.0, one_scan=False, reserve_offset=-1,
                          residual_weights=False, **EDGES.kernel_args())
    with pytest.raises(ValueError, match="plan is for queries"):
        layer.run(q[:2], step_plan, None)
    with pytest.raises(ValueError, match="q must be a float CPU tensor"):
        layer.run(q.long(), step_plan, None)
    with pytest.raises(ValueError, match="out must be"):
        layer.run(q, step_plan, torch.empty(len(LENS), 6, 32))


def test_ops_take_their_arguments_by_name_and_refuse_unknown_or_missing_ones():
    """Every op is called by keyword: a misspelt name, a missing one and a wrong type fail naming
    the argument (a positional list would shift silently)."""
    counts, mass = torch.zeros(1, 1, 5, dtype=torch.long), torch.zeros(1, 1, 1, 3, dtype=torch.float64)
    args = dict(counts=counts, mass=mass, chunk_req=torch.zeros(1, dtype=torch.long),
                per_head=torch.empty(1, 1, 2, dtype=torch.long), per_req=torch.empty(1, 3, dtype=torch.long),
                masses=torch.empty(1, 1, 3, dtype=torch.float64))
    OPS.chunk_totals(**args)
    with pytest.raises(ValueError, match="unknown argument 'mases'"):
        OPS.chunk_totals(**args, mases=mass)
    with pytest.raises(ValueError, match="missing argument 'masses'"):
        OPS.chunk_totals(**{k: v for k, v in args.items() if k != "masses"})
    with pytest.raises(ValueError, match="argument 'mass' must be a tensor"):
        OPS.chunk_totals(**{**args, "mass": 1.0})


def test_fp32_exp_error_bound_holds_for_every_input():
    """The candidate masses rest on exp_ps16's error bound: checked for every fp32 x whose e^x is
    a normal fp32 (the kernels clamp to [-87, 88] where a bound depends on it)."""
    worst, bound = OPS.exp_ps16_error(-87.3, 88.0)
    assert 0.0 < worst <= bound


def test_dropped_mass_exp_bounds_every_input_from_above():
    """The dropped tokens' masses take exp_up: at least e^x with room for x's own fp32 roundings
    (a factor above 1 + 2^-15, i.e. e^x' for any x' within 3e-5 of x) and at most 0.83 % above it,
    for every fp32 x in the range the kernels clamp to."""
    low, high = OPS.exp_up_ratio(-87.0, 88.0)
    assert 1.0 + 2.0**-15 < low
    assert high <= 1.0083


def _setup_rows(gen, rows, dim, dtype, case):
    """Codebook rows (lo, scale, radius) [rows, dim] of ``dtype`` for page_setup's check."""
    lo = torch.randn(rows, dim, generator=gen) * 2
    scale = torch.rand(rows, dim, generator=gen) * 0.05
    radius = torch.rand(rows, dim, generator=gen) * 1e-3
    if case == "wide":  # every magnitude from subnormal to near overflow once multiplied by q
        lo = lo * torch.exp2(torch.randint(-140, 100, (rows, dim), generator=gen).float())
        scale = scale * torch.exp2(torch.randint(-140, 100, (rows, dim), generator=gen).float())
    elif case == "inf":  # a few non-finite codebook entries
        flat = scale.view(-1)
        flat[torch.randint(0, flat.numel(), (5,), generator=gen)] = float("inf")
        lo.view(-1)[torch.randint(0, flat.numel(), (5,), generator=gen)] = float("nan")
    elif case == "zero":  # pages whose scale is zero in every channel (all weights 0)
        scale[::3] = 0
    return tuple(x.to(dtype).contiguous() for x in (lo, scale, radius))


@pytest.mark.parametrize("dim,groups", [(64, 3), (128, 8), (16, 1), (48, 4)])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["normal", "wide", "inf", "zero"])
def test_page_setup_in_one_pass_equals_its_three_steps(dim, groups, bits, dtype, case):
    """The attend pass opens each page with page_setup (the codebook, the page terms and the int8
    weights in one pass per head): its page bounds, offsets, magnitudes, steps and weights must be
    those of load_codebook, page_terms and quantize_weights bit for bit, since the certified pass
    computes them the same way and the token bounds must round alike in both."""
    gen = torch.Generator().manual_seed(dim * 131 + groups * 7 + bits)
    q = torch.randn(groups, dim, generator=gen) * 3
    if case == "wide":
        q = q * torch.exp2(torch.randint(-30, 30, (groups, dim), generator=gen).float())
    elif case == "inf":
        q[0, 1] = float("nan")
    elif case == "zero":
        q[-1] = 0
    lo, scale, radius = _setup_rows(gen, 96, dim, dtype, case)
    differ = OPS.page_setup_mismatches(q=q.contiguous(), lo=lo, scale=scale, radius=radius, bits=bits)
    if differ == -1:
        pytest.skip("this build opens pages in three steps (no AVX-512, or the AVX2 lane-group rule)")
    assert differ == 0


def test_exact_part_rejects_a_narrow_sample_buffer():
    q, k, _, plan, _ = _batch(torch.float32, sample_size=40)
    with pytest.raises(RuntimeError, match="sample buffer"):
        compiled_exact_part(q, k, plan, 0.125, 8, OPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merge_matches_torch(dtype):
    q, k, v, plan, _ = _batch(dtype, groups=2, h_kv=3, dim=64)
    sigma = 0.125
    ex = exact_part(q, k, plan, sigma)
    batch, heads = q.shape[:2]
    gen = torch.Generator().manual_seed(9)
    chunk_req = torch.tensor([0, 0, 1, 1, 1, 3, 4, 4])  # requests 2 and 5 have no chunk
    n = len(chunk_req)
    m = torch.randn(n, heads, generator=gen) * 3
    m[1, :2] = -math.inf  # empty chunk states
    l = torch.rand(n, heads, generator=gen) * 5 + 0.1
    l[1, :2] = 0.0
    o = torch.randn(n, heads, 64, generator=gen)
    o[1, :2] = 0.0
    want = merge_reference(ex, m.view(n, 3, 2), l.view(n, 3, 2), o.view(n, 3, 2, 64), chunk_req, v, plan, sigma, batch)
    got = torch.empty(batch, heads, 64)
    OPS.merge_chunks(s_dense=ex.s_dense, dense_slots=plan.dense_slots, dense_req=plan.dense_req, v_cache=v, m=m, l=l,
                     o=o, chunk_req=chunk_req, sigma=sigma, out=got)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _run_certified(q, plan, store, ref, z_lb, sigma, eps, residual=False):
    """The op with every output (token and page bounds included) in a dict."""
    n, heads, batch, size = len(plan.page_ids), q.shape[1], q.shape[0], store.page_size
    out = dict(hist=torch.empty(batch, heads, th.EDGE_COUNT + 2, dtype=torch.float64),
               habs=torch.empty(batch, heads, th.EDGE_COUNT + 2, dtype=torch.float64), t=torch.empty(batch, heads),
               cert=torch.empty(batch, heads, dtype=torch.float64), tok=torch.empty(n, size, heads),
               pb=torch.empty(n, heads))
    meta = store.tensors
    OPS.certified_threshold(q=q, page_ids=plan.page_ids, page_req=plan.page_req, lo=meta["lo"], scale=meta["scale"],
                            radius=meta["radius"], codes=meta["codes"], ref=ref, z_lb=z_lb, sigma=sigma,
                            eps_budget=eps * th.BUDGET_SAFETY, rounding=th.HIST_ROUNDING,
                            bits=store.config.grid_bits, page_size=size, residual_weights=residual,
                            **EDGES.kernel_args(), hist=out["hist"],
                            habs=out["habs"], t=out["t"], certificate=out["cert"], tok=out["tok"], pb=out["pb"])
    return out


def _index_and_run(cfg, k, q, table, lens, eps, residual=False):
    """The index of the paged keys k [slots, H_kv, D], the plan, the compiled exact part and the
    certified op's outputs for queries q [B, H_q, D]: (plan, store, ex, sigma, out)."""
    from louver_sgl import PageIndexStore

    store = PageIndexStore(cfg, len(k) // cfg.page_size, k.shape[1], k.shape[2], k.dtype)
    store.build_pages(k, torch.arange(store.num_pages))
    plan = plan_decode(table, lens, cfg)
    sigma = 1 / math.sqrt(k.shape[2])
    ex, _ = compiled_exact_part(q, k, plan, sigma, cfg.sample_size, OPS)
    return plan, store, ex, sigma, _run_certified(q, plan, store, ex.ref, ex.z_lb, sigma, eps, residual)


def _page_scores(k, rows, plan, page_size):
    """fp64 scores [n, P, H_q] of every slot of the plan's n indexed pages against their request's
    query rows [n, H_kv, G, D]."""
    slots = plan.page_ids[:, None] * page_size + torch.arange(page_size)
    return torch.einsum("npkd,nkgd->npkg", k[slots].double(), rows.double()).reshape(len(slots), page_size, -1)


def _certified_case(bits, page_size, dim, eps, dtype=torch.float32, scale=2.0, residual=False, groups=3):
    cfg = LouverConfig(page_size=page_size, grid_bits=bits, policy="certified", eps=eps, sample_size=32)
    h_kv = 2
    stretch = max(1, page_size // 32)  # large pages: as many indexed pages as at page 32
    k, _, table, lens = make_paged([300 * stretch, 700 * stretch, 129 * stretch], page_size, h_kv, dim, seed=11,
                                   dtype=dtype)
    q = torch.randn(3, h_kv * groups, dim, generator=torch.Generator().manual_seed(12)) * scale
    plan, store, ex, sigma, out = _index_and_run(cfg, k, q, table, lens, eps, residual)
    return cfg, k, q, plan, store, ex, sigma, out


@pytest.mark.parametrize("bits,page_size,dim", [(4, 16, 64), (8, 16, 64), (4, 32, 128), (8, 8, 64), (2, 16, 64),
                                                (4, 16, 96), (8, 256, 64)])
@pytest.mark.parametrize("residual", [False, True], ids=["int8", "residual"])
def test_certified_threshold_bounds_are_the_int8_bounds_and_enclose_scores(bits, page_size, dim, residual, groups=3):
    """The op's token bounds (VNNI 16-token blocks with 4- and 8-bit codes, the per-token path for
    pages of 8, no VNNI for 2 bits and D = 96; with and without residual weights) equal the torch
    int8 bounds up to fp32 rounding, its page bounds the store's, and both are >= every fp64 exact
    score."""
    cfg, k, q, plan, store, ex, sigma, out = _certified_case(bits, page_size, dim, eps=1e-2, residual=residual,
                                                             groups=groups)
    n, h_kv = len(plan.page_ids), 2
    rows = q.view(3, h_kv, groups, dim)[plan.page_req]
    bounds = store.page_bounds(rows, plan.page_ids)
    codes = store.page_codes(plan.page_ids)
    rule = Int8Rule.of_build(bits)  # lane groups for 8-bit codes on AVX2 builds, else ±127
    residual = residual and groups <= 4  # larger groups keep one dot (CpuLaunch.residual_weights)
    want = int8_token_bounds_reference(*bounds.terms, codes, bits, residual, rule).reshape(n, page_size, -1)
    torch.testing.assert_close(out["tok"], want, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(out["pb"], bounds.page_bound.reshape(n, -1), atol=1e-3, rtol=1e-4)
    exact = _page_scores(k, rows, plan, page_size)
    assert bool((out["tok"].double() >= exact).all())
    assert bool((out["pb"].double()[:, None, :] >= exact).all())
    fp32_bounds = store.token_bounds(bounds, plan.page_ids).reshape(n, page_size, -1)
    assert bool((out["tok"] >= fp32_bounds - 1e-3).all())  # int8 weights only loosen the bound


LANE_GROUPS = {  # query weights on channels of lane group (block 0, parity 0): 0, 1, 4, 5
    "equal": {0: 1.0, 1: -1.0, 4: 1.0, 5: -1.0},  # the step from the group's sum: Σ|wq| at ~125
    "one-heavy": {0: 1.0, 1: 0.6, 4: -0.3, 5: 0.2},
    "same-sign": {0: 1.0, 1: 1.0, 4: 1.0, 5: 1.0},
    "two-groups": {0: 1.0, 1: 1.0, 4: 1.0, 5: 1.0, 2: -1.0, 3: -1.0, 6: -1.0, 7: -1.0},
}


@pytest.mark.parametrize("pattern", sorted(LANE_GROUPS))
@pytest.mark.parametrize("page_size", [16, 128])
@pytest.mark.parametrize("residual", [False, True], ids=["int8", "residual"])
def test_int8_lanes_hold_at_the_edge_of_the_weight_rule(pattern, page_size, residual):
    """Keys whose codes sit at 0 and 255 on the channels of one int16 lane group, queried with all
    their weight there: each lane's sum reaches the rule's edge (255·Σ|wq| up to 32,640; a single
    extra unit of weight per channel would saturate the AVX2 scan's int16 lanes). The op's bounds
    equal the torch specification's under this build's rule (``Int8Rule.of_build``) and enclose
    every fp64 score; the rule keeps |wq| <= 127, and on builds with lane groups Σ|wq| <= 128 per
    lane group of every page."""
    dim, h_kv, groups = 64, 2, 3
    cfg = LouverConfig(page_size=page_size, grid_bits=8, policy="certified", eps=1e-2, sample_size=32)
    k, _, table, lens = make_paged([40 * page_size, 20 * page_size], page_size, h_kv, dim, seed=5)
    gen = torch.Generator().manual_seed(6)
    k.mul_(0.01)
    channels = sorted(LANE_GROUPS[pattern])
    k[..., channels] = torch.where(torch.rand(len(k), h_kv, len(channels), generator=gen) < 0.5, -3.0, 3.0)
    q = 0.01 * torch.randn(2, h_kv * groups, dim, generator=gen)
    for c, w in LANE_GROUPS[pattern].items():
        q[..., c] = 4.0 * w
    plan, store, _, _, out = _index_and_run(cfg, k, q, table, lens, 1e-2, residual)
    n = len(plan.page_ids)
    rows = q.view(2, h_kv, groups, dim)[plan.page_req]
    bounds = store.page_bounds(rows, plan.page_ids)
    rule = Int8Rule.of_build(8)
    weights = bounds.terms[0]
    wq = torch.round(weights / rule.step(weights)).abs()
    assert float(wq.amax()) <= rule.limit
    if rule.group_limit > 0:  # the AVX2 8-bit scan's int16 lanes (VNNI builds widen every product to int32)
        assert float(lane_group_sums(wq).amax()) <= 128
    want = int8_token_bounds_reference(*bounds.terms, store.page_codes(plan.page_ids), 8, residual, rule)
    torch.testing.assert_close(out["tok"], want.reshape(n, page_size, -1), atol=1e-3, rtol=1e-4)
    assert bool((out["tok"].double() >= _page_scores(k, rows, plan, page_size)).all())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("groups", [5, 8])
def test_large_groups_with_residual_weights(bits, groups):
    """Groups of 5-8 query heads per KV head ask for residual weights: the kernels keep one integer
    dot per head there (the dot kernels hold 8 rows), so the bounds are the plain int8 ones, and
    they enclose every score."""
    test_certified_threshold_bounds_are_the_int8_bounds_and_enclose_scores(bits, 16, 64, True, groups)


@pytest.mark.parametrize("bits,page_size,dim", [(4, 16, 64), (8, 8, 64), (2, 16, 64)])
@pytest.mark.parametrize("eps", [1e-1, 1e-3])
def test_certified_threshold_matches_reference(bits, page_size, dim, eps):
    """Histograms of the op's bounds equal the torch specification's (exp_ps16 masses are upper
    bounds within 2^-15), and T and the certificate are the largest edge whose bound fits."""
    cfg, k, q, plan, store, ex, sigma, out = _certified_case(bits, page_size, dim, eps=eps)
    args = (out["pb"], out["tok"], plan.page_req, ex.ref, ex.z_lb, sigma, eps * th.BUDGET_SAFETY, th.HIST_ROUNDING)
    t_ref, cert_ref, hist_ref, habs_ref = certified_threshold_reference(*args)
    assert bool((out["habs"] >= habs_ref * (1 - 1e-12)).all())
    torch.testing.assert_close(out["habs"], habs_ref, rtol=1e-4, atol=1e-12)
    torch.testing.assert_close(out["hist"].cumsum(-1), hist_ref.cumsum(-1), rtol=1e-4, atol=1e-9)
    bound = (out["hist"].cumsum(-1) + th.HIST_ROUNDING * out["habs"].cumsum(-1))[..., : th.EDGE_COUNT]
    edge = th.pick_edge(bound, eps * th.BUDGET_SAFETY * ex.z_lb)
    assert torch.equal(out["t"], th.edge_threshold(edge, ex.ref, sigma))
    chosen = torch.where(edge < 0, 0.0, bound.gather(-1, edge.clamp(min=0)[..., None])[..., 0])
    assert torch.equal(out["cert"], chosen)
    assert bool((out["cert"] <= eps * ex.z_lb).all())
    assert torch.equal(out["t"], t_ref)
    torch.testing.assert_close(out["cert"], cert_ref, rtol=1e-4, atol=1e-12)
    assert bool(torch.isfinite(out["t"]).any()) and bool((edge < th.EDGE_COUNT - 1).any())  # a real choice


def test_certified_threshold_takes_its_edges_from_the_caller():
    """The edges are the caller's data (contract.ThresholdEdges), not constants of the kernel: with
    coarser levels the op's histograms, T and certificate are the specification's with those."""
    from louver_sgl.decode.contract import ThresholdEdges

    edges = ThresholdEdges(low=-40.0, step=0.5, count=97, margin=1e-5)
    cfg, k, q, plan, store, ex, sigma, _ = _certified_case(4, 16, 64, eps=1e-2)
    n, heads, batch = len(plan.page_ids), q.shape[1], q.shape[0]
    out = dict(hist=torch.empty(batch, heads, edges.hist_width, dtype=torch.float64),
               habs=torch.empty(batch, heads, edges.hist_width, dtype=torch.float64), t=torch.empty(batch, heads),
               certificate=torch.empty(batch, heads, dtype=torch.float64), tok=torch.empty(n, 16, heads),
               pb=torch.empty(n, heads))
    meta = store.tensors
    OPS.certified_threshold(q=q, page_ids=plan.page_ids, page_req=plan.page_req, **{m: meta[m] for m in meta},
                            ref=ex.ref, z_lb=ex.z_lb, sigma=sigma, eps_budget=1e-2 * th.BUDGET_SAFETY,
                            rounding=th.HIST_ROUNDING, bits=4, page_size=16, residual_weights=False,
                            **edges.kernel_args(), **out)
    t_ref, cert_ref, hist_ref, habs_ref = certified_threshold_reference(
        out["pb"], out["tok"], plan.page_req, ex.ref, ex.z_lb, sigma, 1e-2 * th.BUDGET_SAFETY, th.HIST_ROUNDING, edges)
    torch.testing.assert_close(out["habs"], habs_ref, rtol=1e-4, atol=1e-12)
    assert torch.equal(out["t"], t_ref) and bool(torch.isfinite(t_ref).any())
    torch.testing.assert_close(out["certificate"], cert_ref, rtol=1e-4, atol=1e-12)
    default = certified_threshold_reference(out["pb"], out["tok"], plan.page_req, ex.ref, ex.z_lb, sigma,
                                            1e-2 * th.BUDGET_SAFETY, th.HIST_ROUNDING)[0]
    assert not torch.equal(default, t_ref)  # the levels did change the choice


def test_certified_threshold_handles_nan_and_huge_bounds():
    """A NaN in a query row makes its head's bounds NaN: none of its mass is counted (its keys are
    kept, never below T); bounds far above ref (x > 80, past exp_ps16's range) take the fp64 exp.
    The histograms still match the specification's."""
    cfg, k, q, plan, store, ex, sigma, _ = _certified_case(4, 16, 64, eps=1e-2)
    q = q.clone()
    q[1, 4, 7] = float("nan")
    ref = ex.ref.clone()
    ref[0, 2] -= 100 / sigma
    out = _run_certified(q, plan, store, ref, ex.z_lb, sigma, 1e-2)
    _, _, hist_ref, habs_ref = certified_threshold_reference(
        out["pb"], out["tok"], plan.page_req, ref, ex.z_lb, sigma, 1e-2 * th.BUDGET_SAFETY, th.HIST_ROUNDING)
    assert bool(out["tok"][plan.page_req == 1][..., 4].isnan().all())
    assert bool((out["hist"][1, 4] == 0).all()) and bool((out["habs"][1, 4] == 0).all())
    assert float(habs_ref[0, 2, th.EDGE_COUNT]) > math.exp(80)  # huge masses past the last edge
    torch.testing.assert_close(out["habs"], habs_ref, rtol=1e-4, atol=1e-12)
    torch.testing.assert_close(out["hist"].cumsum(-1), hist_ref.cumsum(-1), rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("bits,dim", [(4, 64), (8, 64), (2, 64), (4, 96)])
@pytest.mark.parametrize("policy", ["budget", "certified"])
def test_compiled_step_is_the_same_in_both_code_layouts(bits, dim, policy):
    """The compiled step reads block16 codes (VNNI blocks as stored, or gathered per token) to the
    same bounds as token-layout codes: identical outputs and statistics. The certificate's masses
    agree to their fp32 exps' slack (kMassUp, 2^-15): on AVX2 builds token-layout pages take the
    per-token scan, which bounds each dropped token's mass with an fp64 exp, where the 8-lane block
    scan sums fp32 exps raised by kMassUp (both upper bounds of the same masses)."""
    from louver_sgl import PageIndexStore
    from louver_sgl.decode import louver_decode

    cfg = LouverConfig(page_size=32, grid_bits=bits, policy=policy, budget=0.1, eps=1e-2, sample_size=40)
    k, v, table, lens = make_paged([700, 300, 45], 32, 2, dim, seed=11, dtype=torch.float16)
    q = torch.randn(3, 6, dim, generator=torch.Generator().manual_seed(12)) * 2
    plan = plan_decode(table, lens, cfg)
    runs = []
    for layout in ("token", "block16"):
        store = PageIndexStore(cfg, len(k) // 32, 2, dim, k.dtype, code_layout=layout)
        store.build_pages(k, plan.page_ids)
        runs.append(louver_decode(q, k, v, table, lens, store, 1 / math.sqrt(dim), impl="cpu"))
    (out_a, st_a), (out_b, st_b) = runs
    assert torch.equal(out_a, out_b)
    for name in ("threshold", "candidates", "union_candidates", "pages_read"):
        assert torch.equal(getattr(st_a, name), getattr(st_b, name)), name
    torch.testing.assert_close(st_a.mass_bound, st_b.mass_bound, rtol=2.0**-14, atol=0.0)
