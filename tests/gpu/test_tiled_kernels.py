"""``triton_tiled`` (``louver_kernels.triton.tiled_decode``) against the specification and the
other Triton implementation.

On a machine without CUDA the kernels run under ``TRITON_INTERPRET=1`` on tiny fp16/fp32 inputs
(the conformance suite holds them to the contract on every policy and layout); here: the lists
and the certified level in one pass over the codes are what the rules say, both compactions give
the same step, the window's edges behave as documented, and a step reads nothing on the host.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conftest import SLOW_WHERE_INTERPRETED, compiled_attended, fp64_request, make_paged  # noqa: E402
from louver_kernels.triton.launch import TritonLaunch  # noqa: E402
from louver_sgl import LouverConfig, PageIndexStore  # noqa: E402
from louver_sgl.decode import HeadShapes, LouverDecode  # noqa: E402
from louver_sgl.decode.reference_compiled import Int8Rule  # noqa: E402

pytestmark = SLOW_WHERE_INTERPRETED  # the full tier where there is no CUDA (conftest)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENS = [300, 701, 20, 64, 129]
P = 16


def _case(policy: dict, dtype=torch.float16, seed=0, groups=3, dim=64, lens=LENS):
    config = LouverConfig(page_size=P, sample_size=32, **policy)
    k, v, table, lens_t = make_paged(lens, P, 2, dim, seed=seed, dtype=dtype)
    store = PageIndexStore(config, len(k) // P, 2, dim, dtype, DEVICE, code_layout="token")
    store.build_pages(k.to(DEVICE), torch.arange(store.num_pages, device=DEVICE))
    q = (torch.randn(len(lens), 2 * groups, dim, generator=torch.Generator().manual_seed(seed + 1)) * 2).to(dtype)
    return config, q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), table.to(DEVICE), lens_t.to(DEVICE), store


def _run(impl, config, q, k, v, table, lens, store, launch=None, sigma=0.125):
    decode = LouverDecode(config, DEVICE, impl=impl, launch=launch)
    return decode.plan(table, lens).run(q, k, v, store, sigma, attended=True)


def _union(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """``[H_q, L]`` -> the GQA union per KV head, repeated to its heads."""
    h, n = mask.shape
    return mask.view(h // groups, groups, n).any(1).repeat_interleave(groups, 0)


@pytest.mark.parametrize("policy", [dict(policy="budget", budget=0.1), dict(policy="fixed", fixed_threshold=3.0)],
                            ids=["budget", "fixed"])
def test_lists_hold_the_gqa_union_of_the_gate(policy):
    """Budget and fixed: same T as ``triton``, and every head attends its group's union of the
    candidates at T (the value gate aside): the union ``triton``'s heads attend together."""
    config, q, k, v, table, lens, store = _case(dict(policy, value_gate=False))
    tiled = _run("triton_tiled", config, q, k, v, table, lens, store)
    fused = _run("triton", config, q, k, v, table, lens, store)
    torch.testing.assert_close(tiled.stats.threshold, fused.stats.threshold, atol=0, rtol=0)
    assert torch.equal(tiled.stats.union_candidates, fused.stats.union_candidates)
    for b in range(len(LENS)):
        assert torch.equal(tiled.attended[b], _union(fused.attended[b], 3)), f"request {b}"


@pytest.mark.parametrize("policy", [dict(policy="budget", budget=0.1), dict(policy="certified", eps=0.05)],
                         ids=["budget", "certified"])
def test_atomic_and_ordered_lists_give_the_same_step(policy):
    """One atomic per tile (list order unspecified) or each tile's own region and a prefix sum:
    the same T, attended sets, counters and bound; the output within the rounding of another
    summation order."""
    config, q, k, v, table, lens, store = _case(policy, dtype=torch.float32)
    ordered = _run("triton_tiled", config, q, k, v, table, lens, store, TritonLaunch(tile_atomic=0))
    atomic = _run("triton_tiled", config, q, k, v, table, lens, store, TritonLaunch(tile_atomic=1))
    for name in ("threshold", "candidates", "union_candidates", "values_read", "pages_read", "pages_skipped"):
        assert torch.equal(getattr(ordered.stats, name), getattr(atomic.stats, name)), name
    torch.testing.assert_close(ordered.stats.mass_bound, atomic.stats.mass_bound, atol=1e-12, rtol=1e-9)
    assert all(torch.equal(a, b) for a, b in zip(ordered.attended, atomic.attended))
    torch.testing.assert_close(ordered.out, atomic.out, atol=1e-5, rtol=1e-5)


def test_the_certified_level_is_the_histogram_rules_in_one_pass():
    """Certified, one pass over the codes: where the histogram rule's edge lies in the window,
    the step's T sits at that edge (just above it: ``triton`` places T just below it), and the
    attended set is the union of the keys whose int8 bounds reach T."""
    config, q, k, v, table, lens, store = _case(dict(policy="certified", eps=0.05))
    launch = TritonLaunch(window_edges=128)  # wide enough for these few keys' levels
    tiled = _run("triton_tiled", config, q, k, v, table, lens, store, launch)
    fused = _run("triton", config, q, k, v, table, lens, store)
    assert not bool(tiled.stats.dense_fallback.any())
    indexed = tiled.stats.num_indexed > 0
    diff = (tiled.stats.threshold - fused.stats.threshold)[indexed]
    assert bool((diff.abs() <= 1e-4 * (fused.stats.threshold[indexed].abs() + 1)).all()), diff
    # the compiled CPU kernels' own bounds where this build's int8 weights are the Triton kernels'
    # (±127); on AVX2 builds, whose 8-bit weights follow the lane groups' rule, the torch int8
    # specification at ±127
    same_weights = Int8Rule.of_build(config.grid_bits) == Int8Rule()
    spec = compiled_attended(q.cpu(), k.cpu(), table.cpu(), lens.cpu(), store, tiled.stats.threshold.cpu(),
                             kernel_bounds=same_weights, weight_rule=Int8Rule())
    for b in range(len(LENS)):
        assert torch.equal(tiled.attended[b], _union(spec[b], 3)), f"request {b}"
    assert bool((tiled.stats.mass_bound < config.eps).all())


def _check_certified(config, q, k, v, table, lens, result, sigma=0.125):
    stats = result.stats
    assert bool((stats.mass_bound < config.eps).all())
    for b in range(len(LENS)):
        scores, _ = fp64_request(q.cpu(), k.cpu(), v.cpu(), table.cpu(), lens.cpu(), b, P)
        mask = result.attended[b]
        assert not bool(((scores >= stats.threshold[b].cpu().double()[:, None]) & ~mask).any())
        dropped = (torch.softmax(sigma * scores, dim=1) * ~mask).sum(1)
        assert bool((dropped <= stats.mass_bound[b].cpu() + 1e-12).all())


def test_a_narrow_window_keeps_a_superset_and_still_certifies():
    """Two window edges: a head whose rule's edge lies above them keeps the top edge's keys (more
    than the rule's, never fewer), still certified."""
    config, q, k, v, table, lens, store = _case(dict(policy="certified", eps=0.05))
    wide = _run("triton_tiled", config, q, k, v, table, lens, store, TritonLaunch(window_edges=128))
    narrow = _run("triton_tiled", config, q, k, v, table, lens, store, TritonLaunch(window_edges=2))
    assert bool((narrow.stats.threshold <= wide.stats.threshold).all())
    assert bool((narrow.stats.threshold < wide.stats.threshold).any())
    for b in range(len(LENS)):
        assert bool((narrow.attended[b] | ~wide.attended[b]).all())
    _check_certified(config, q, k, v, table, lens, narrow)


def test_a_level_below_the_window_attends_densely():
    """A window starting far above the safe level: where its lowest edge does not fit, the
    request attends every key (bound 0) in the second attention launch."""
    config, q, k, v, table, lens, store = _case(dict(policy="certified", eps=0.05))
    result = _run("triton_tiled", config, q, k, v, table, lens, store, TritonLaunch(window_start=200))
    stats = result.stats
    dense = stats.dense_fallback
    assert bool(dense[stats.num_indexed > 0].all())
    for b in range(len(LENS)):
        assert bool(result.attended[b].all())
        scores, values = fp64_request(q.cpu(), k.cpu(), v.cpu(), table.cpu(), lens.cpu(), b, P)
        want = torch.einsum("hl,lhd->hd", torch.softmax(0.125 * scores, dim=1), values)
        torch.testing.assert_close(result.out[b].double().cpu(), want, atol=8e-3 * values.abs().max().item(), rtol=0)
    assert float(stats.mass_bound.abs().max()) == 0.0


@pytest.mark.parametrize("policy", [dict(policy="budget", budget=0.1), dict(policy="certified", eps=0.05)],
                         ids=["budget", "certified"])
def test_head_dim_128_and_a_group_of_four(policy):
    """Llama-3-8B's layout (D = 128, four query heads per KV head: one 16-row tile is four pages)."""
    config, q, k, v, table, lens, store = _case(policy, groups=4, dim=128, seed=3)
    result = _run("triton_tiled", config, q, k, v, table, lens, store, sigma=1 / math.sqrt(128))
    if config.threshold.certified:  # (``triton`` may sit a bin lower: its histogram lowers each unit's bin)
        _check_certified(config, q, k, v, table, lens, result, sigma=1 / math.sqrt(128))
        return
    fused = _run("triton", config, q, k, v, table, lens, store, sigma=1 / math.sqrt(128))
    assert torch.equal(result.stats.union_candidates, fused.stats.union_candidates)


@pytest.mark.parametrize("atomic", [0, 1])
def test_a_planned_step_reads_nothing_on_the_host_and_keeps_its_buffers(atomic, monkeypatch):
    """Graph safety: with every host read of a tensor value made an error, a planned certified
    step runs through (every launch of it), equals the eager step, and the workspace's tensors
    keep their addresses."""
    config, q, k, v, table, lens, store = _case(dict(policy="certified", eps=0.05, dense_fallback_fraction=0.9),
                                                dtype=torch.float32)
    decode = LouverDecode(config, DEVICE, impl="triton_tiled", launch=TritonLaunch(tile_atomic=atomic),
                          shapes=HeadShapes(6, 2, 64, 64), max_batch=len(LENS), max_pages=table.shape[1])
    ws = decode.impl.workspace
    addresses = {name: t.data_ptr() for name, t in vars(ws).items() if isinstance(t, torch.Tensor)}
    out = torch.empty(len(LENS), 6, 64, device=DEVICE)
    decode.plan(table, lens).run(q, k, v, store, 0.125, out=out)
    before = out.clone()

    def host_read(*_args, **_kwargs):
        raise AssertionError("a tensor value was read on the host")

    plan = decode.plan(table, lens).current_plan
    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    from louver_sgl.decode.impl_triton_tiled import tiled_step
    tiled_step(q, k, v, plan.workspace, store, 0.125, config, decode.impl.launch, out, None)
    monkeypatch.undo()
    torch.testing.assert_close(out, before, atol=1e-6 if atomic else 0, rtol=0)
    assert {name: t.data_ptr() for name, t in vars(ws).items() if isinstance(t, torch.Tensor)} == addresses


def test_refused_options_name_themselves():
    for changes, option in ((dict(certified_passes=1), "certified_passes=1"),
                            (dict(certified_rule="a_posteriori"), "certified_rule='a_posteriori'")):
        with pytest.raises(ValueError, match=f"{option} is not supported by the 'triton_tiled'"):
            LouverDecode(LouverConfig(policy="certified", **changes), DEVICE, impl="triton_tiled")
