"""Triton kernels of the GPU path against the torch specification and an fp64 brute force.

On a machine without CUDA the kernels run under ``TRITON_INTERPRET=1`` (set here, before the
kernels are imported) on tiny fp16/fp32 inputs; with CUDA the same tests run natively, bf16 too
(the interpreter's bf16 dot is not faithful, so bf16 cases need a GPU).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conftest import SLOW_WHERE_INTERPRETED, fp64_request, make_paged  # noqa: E402
from louver_kernels.triton.grid_build import grid_build  # noqa: E402
from louver_kernels.triton.launch import TritonLaunch  # noqa: E402
from louver_sgl import LouverConfig, PageIndexStore  # noqa: E402
from louver_sgl.decode import HeadShapes, LouverDecode  # noqa: E402
from louver_sgl.decode.impl_triton import GpuWorkspace  # noqa: E402
from louver_sgl.decode.reference import reference_decode  # noqa: E402
from louver_sgl.index import grid  # noqa: E402

pytestmark = SLOW_WHERE_INTERPRETED  # the full tier where there is no CUDA (conftest)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
LENS = [300, 700, 20, 64, 129]
P = 16
SPLITS = TritonLaunch(pages_per_split=4)


def _keys(dtype, pages=6, h_kv=2, dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(pages * P, h_kv, dim, generator=gen) * 3
    k[:, :, :4] += 40 * torch.randn(pages * P, h_kv, 1, generator=gen)  # wide channels
    return k.to(dtype)


def _built(keys, ids, bits):
    pages = keys.shape[0] // P
    h_kv, dim = keys.shape[1:]
    dev = keys.to(DEVICE)
    out = {n: torch.full((pages, h_kv, dim), 7.0, dtype=keys.dtype, device=DEVICE) for n in ("lo", "scale", "radius")}
    out["codes"] = torch.zeros(pages * P, h_kv, dim * bits // 8, dtype=torch.uint8, device=DEVICE)
    grid_build(dev, ids.to(DEVICE), out["lo"], out["scale"], out["radius"], out["codes"], P, bits)
    return {n: t.cpu() for n, t in out.items()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_grid_build_matches_torch_and_encloses(dtype, bits):
    """lo, scale and codes equal the torch build bit for bit; the radius encloses every member
    around the exact center (fp64) and equals the torch radius for 16-bit storage."""
    keys = _keys(dtype)
    ids = torch.tensor([4, 0, 5, 2])
    got = _built(keys, ids, bits)
    want = grid.build_grid(keys.view(-1, P, *keys.shape[1:])[ids], bits, dtype)
    assert torch.equal(got["lo"][ids], want["lo"])
    assert torch.equal(got["scale"][ids], want["scale"])
    codes = got["codes"].view(-1, P, *got["codes"].shape[1:])[ids]
    assert torch.equal(codes, want["codes"])
    if dtype != torch.float32:  # fp32 centers of the torch build are rounded; ours are exact
        assert torch.equal(got["radius"][ids], want["radius"])
    center = got["lo"][ids].double().unsqueeze(1) + (
        grid.unpack_codes(codes, bits).double() + 0.5) * got["scale"][ids].double().unsqueeze(1)
    member = keys.view(-1, P, *keys.shape[1:])[ids].double()
    assert bool(((member - center).abs() <= got["radius"][ids].double().unsqueeze(1)).all())
    untouched = torch.tensor([1, 3])
    assert bool((got["lo"][untouched] == 7.0).all())


def test_grid_build_is_deterministic_and_keeps_non_finite_pages():
    keys = _keys(torch.float16)
    keys[5 * P + 3, 1, 7] = float("inf")
    ids = torch.arange(6)
    first, second = _built(keys, ids, 8), _built(keys, ids, 8)
    assert all(torch.equal(first[n], second[n]) for n in first)
    assert bool(torch.isinf(first["radius"][5, 1]).all())
    assert bool(torch.isfinite(first["radius"][:5]).all())


def _setup(policy, dtype, dim=64, groups=3, seed=0, **cfg):
    config = LouverConfig(page_size=P, policy=policy, eps=0.05, fixed_threshold=4.0, budget=0.1,
                          sample_size=32, dense_fallback_fraction=1.0, **cfg)
    k, v, table, lens = make_paged(LENS, P, 2, dim, seed=seed, dtype=dtype)
    store = PageIndexStore(config, len(k) // P, 2, dim, dtype, device=DEVICE, code_layout="token")
    store.build_pages(k.to(DEVICE), torch.arange(store.num_pages, device=DEVICE))
    gen = torch.Generator().manual_seed(seed + 1)
    q = (torch.randn(len(LENS), 2 * groups, dim, generator=gen) * 2).to(dtype)
    return config, q, k, v, table, lens, store


def _run(config, q, k, v, table, lens, store, sigma):
    """One step through the wrapper: (out, stats fields, attended [B, H_q, W·P] bool)."""
    decode = LouverDecode(config, DEVICE, impl="triton", launch=SPLITS).plan(table.to(DEVICE), lens.to(DEVICE))
    step_result = decode.run(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), store, sigma, attended=True)
    out, stats, masks = step_result.out, step_result.stats, step_result.attended
    attended = torch.zeros(len(LENS), q.shape[1], table.shape[1] * P, dtype=torch.bool)
    for b, mask in enumerate(masks):
        attended[b, :, : mask.shape[1]] = mask
    return out.cpu(), {n: getattr(stats, n).cpu() for n in stats.__dataclass_fields__}, attended


def _request(q, k, v, table, lens, b):
    n = int(lens[b])
    pos = torch.arange(n)
    slots = table[b, pos // P] * P + pos % P
    groups = q.shape[1] // k.shape[1]
    kk = k[slots].double().repeat_interleave(groups, 1)
    vv = v[slots].double().repeat_interleave(groups, 1)
    return torch.einsum("hd,lhd->hl", q[b].double(), kk), vv, n


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("policy", ["certified", "budget", "fixed", "dense"])
def test_decode_is_exact_on_its_candidates(policy, dtype):
    """Recall exactly 1.0 against fp64 scores, output = fp64 dense attention over the attended
    set (fp16 tolerance: probabilities meet V in the KV dtype), counts match the mask, and the
    reported dropped-mass bound holds (certified: below eps)."""
    config, q, k, v, table, lens, store = _setup(policy, dtype)
    sigma = 3 / math.sqrt(64)
    out, stats, attended = _run(config, q, k, v, table, lens, store, sigma)
    n_idx = stats["num_indexed"]
    for b in range(len(LENS)):
        s, vv, n = _request(q, k, v, table, lens, b)
        mask = attended[b, :, :n]
        missed = (s >= stats["threshold"][b].double()[:, None]) & ~mask
        assert not bool(missed.any()), "false negatives"
        p = torch.softmax(sigma * s.masked_fill(~mask, -math.inf), dim=1)
        want = torch.einsum("hl,lhd->hd", p, vv)
        tol = 4e-3 if dtype != torch.float32 else 2e-5
        torch.testing.assert_close(out[b].double(), want, atol=tol * vv.abs().max().item(), rtol=0)
        assert bool((stats["candidates"][b] == mask.sum(1) - (n - n_idx[b])).all())
        dropped = (torch.softmax(sigma * s, dim=1) * ~mask).sum(1)
        assert bool((dropped <= stats["mass_bound"][b] + 1e-12).all())
    if policy == "certified":
        assert bool((stats["mass_bound"] < config.eps).all())
    if policy == "dense":
        assert bool((attended.sum(2) == lens[:, None]).all())


@pytest.mark.parametrize("policy", ["budget", "fixed"])
def test_gated_candidates_and_threshold_equal_the_reference(policy):
    """With the value gate, the attended set depends only on exact scores: it equals the torch
    reference's set (the GPU's looser integer token bounds only add gated-out keys)."""
    config, q, k, v, table, lens, store = _setup(policy, torch.float16)
    sigma = 1 / math.sqrt(64)
    cpu_store = PageIndexStore(config, store.num_pages, 2, 64, torch.float16)
    cpu_store.build_pages(k, torch.arange(store.num_pages))
    _, info = reference_decode(q, k, v, table, lens, cpu_store, sigma)
    _, stats, attended = _run(config, q, k, v, table, lens, store, sigma)
    t_ref = torch.stack([i["threshold"] for i in info])
    torch.testing.assert_close(stats["threshold"], t_ref, atol=1e-4, rtol=1e-5)
    for b, n in enumerate(lens.tolist()):
        assert torch.equal(attended[b, :, :n], info[b]["attended"])


def test_head_dim_128_and_all_keys_candidates():
    """D = 128; a threshold below every score makes every key a candidate: no capacity limit,
    the output is dense attention."""
    config, q, k, v, table, lens, store = _setup("fixed", torch.float16, dim=128, groups=4, seed=3)
    config = config.with_(fixed_threshold=-1e30)
    sigma = 1 / math.sqrt(128)
    out, stats, attended = _run(config, q, k, v, table, lens, store, sigma)
    for b in range(len(LENS)):
        s, vv, n = _request(q, k, v, table, lens, b)
        want = torch.einsum("hl,lhd->hd", torch.softmax(sigma * s, dim=1), vv)
        torch.testing.assert_close(out[b].double(), want, atol=4e-3 * vv.abs().max().item(), rtol=0)
        assert bool(attended[b, :, :n].all())
    assert torch.equal(stats["candidates"], stats["num_indexed"][:, None].expand_as(stats["candidates"]))


def test_workspace_views_are_address_stable():
    config = LouverConfig(page_size=P)
    ws = GpuWorkspace.allocate(8, 40, HeadShapes(6, 2, 64, 64), config, SPLITS, DEVICE)
    small = ws.view(3)
    assert small.o.data_ptr() == ws.o.data_ptr() and small.o.shape[0] == 3
    with pytest.raises(ValueError, match="exceeds"):
        ws.view(9)


def test_bad_inputs_are_rejected():
    config, q, k, v, table, lens, store = _setup("budget", torch.float16)
    with pytest.raises(ValueError, match="family='clustered' is not supported by the 'triton' decode implementation"):
        LouverDecode(config.with_(family="clustered"), DEVICE, impl="triton")
    with pytest.raises(ValueError, match="unknown Triton launch"):
        TritonLaunch.from_dict({"pages_per_split": 4, "block": 3})
    with pytest.raises(ValueError, match="power of two"):
        TritonLaunch(attend_warps=3)


@pytest.mark.parametrize("impl", ["triton", "triton_stream"])
@pytest.mark.parametrize("policy, size", [(dict(policy="fixed", fixed_threshold=2.0), 1000.0),
                                          (dict(policy="budget", budget=0.3), 1000.0),
                                          (dict(policy="certified", eps=0.05), 10.0)], ids=["fixed", "budget", "certified"])
def test_the_reported_bound_covers_the_true_dropped_mass_of_cancelling_keys(impl, policy, size):
    """Keys whose fp32 scores err (large cancelling products): the step's reported bound is at
    least the fp64 true dropped softmax mass. Its denominator (the attended mass) and its
    value-gated mass are built from those scores, so each must be lowered or raised by their
    rounding bound as the exact part's are; the value gate drops keys whose bound is tight."""
    from conftest import cancelling_batch

    q, k, v, table, lens = cancelling_batch([300, 700, 129], size=size)  # certified: bounds tight enough to drop
    config = LouverConfig(page_size=16, sample_size=40, **policy)
    store = PageIndexStore(config, len(k) // 16, 2, 64, torch.float32, code_layout="token")
    store.build_pages(k, torch.arange(store.num_pages))
    sigma = 0.125
    decode = LouverDecode(config, "cpu", impl=impl, launch=SPLITS)
    result = decode.plan(table, lens).run(q, k, v, store, sigma, attended=True)
    for b in range(len(lens)):
        scores, _ = fp64_request(q, k, v, table, lens, b, 16)
        p = torch.softmax(sigma * scores, dim=1)
        dropped = (p * ~result.attended[b]).sum(1)
        bound = result.stats.mass_bound[b].double()
        assert bool((dropped > 0).any()), "the case must drop some keys"
        assert bool((dropped <= bound).all()), (b, (dropped - bound).max())
