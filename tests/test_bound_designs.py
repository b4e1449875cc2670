"""The index designs' bounds (``louver_sgl.index.bound_designs``) against an fp64 brute force:
every key's exact score is at most its bound, on adversarial keys (large cancelling components,
constant channels, tiny and huge magnitudes), with NaN and infinite keys kept, and ties kept."""

from __future__ import annotations

import math

import pytest
import torch

from louver_sgl import LouverConfig, PageIndexStore
from louver_sgl.index.bound_designs import (
    allocate_low_bits, block_minmax, block_minmax_bounds, calibrate_channel_weights, calibrate_projection,
    lowrank_bounds, lowrank_terms, nibble_coarse_bounds, project_queries, round_to_fp16,
)
from louver_sgl.index.grid import unpack_codes

P, H_KV, G = 16, 2, 3


def _keys(seed: int, dim: int, dtype=torch.float32, pages: int = 6) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(pages * P, H_KV, dim, generator=gen) * 3
    k[:, :, 0] = 7.0  # a constant channel
    k[:, :, 1] *= 1e3  # a huge one (within fp16)
    k[:, :, 2] *= 1e-30  # a tiny one
    k[: P, :, 3] = -k[P: 2 * P, :, 3]  # components that cancel
    return k.to(dtype)


def _queries(seed: int, dim: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 100)
    q = torch.randn(H_KV, G, dim, generator=gen) * 2
    q[0, 0, 1] = 0.0
    return q


def _exact(q, keys):
    """fp64 q·k ``[n, H_kv, G]``."""
    return torch.einsum("nkd,kgd->nkg", keys.double(), q.double())


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_high_nibbles_bound_every_key(seed, dtype):
    dim = 32
    keys = _keys(seed, dim, dtype)
    store = PageIndexStore(LouverConfig(page_size=P, grid_bits=8), keys.shape[0] // P, H_KV, dim, dtype)
    store.build_pages(keys, torch.arange(store.num_pages))
    ids = torch.arange(store.num_pages)
    t = store.tensors
    q = _queries(seed, dim)
    u = nibble_coarse_bounds(q, t["lo"], t["scale"], t["radius"], unpack_codes(store.page_codes(ids), 8))
    exact = _exact(q, keys).view(store.num_pages, P, H_KV, G)
    assert bool(torch.isfinite(u).all()) and bool((exact <= u).all())
    # coarser than the page's own 8-bit bound by at most 15/2 bins per channel: not vacuous
    assert float((u - exact).median()) < float((exact.abs() + 1).median()) * 10


@pytest.mark.parametrize("seed", range(2))
def test_every_prefix_of_bit_planes_bounds_every_key(seed):
    """The split designs read 1 to 7 high bits of the 8-bit codes: each prefix bounds every key,
    and each more bit tightens the bound (the cell halves)."""
    dim = 32
    keys = _keys(seed, dim, torch.float16)
    store = PageIndexStore(LouverConfig(page_size=P, grid_bits=8), keys.shape[0] // P, H_KV, dim, torch.float16)
    store.build_pages(keys, torch.arange(store.num_pages))
    t = store.tensors
    codes = unpack_codes(store.page_codes(torch.arange(store.num_pages)), 8)
    q = _queries(seed, dim)
    exact = _exact(q, keys).view(store.num_pages, P, H_KV, G)
    slack = []
    for low_bits in range(7, 0, -1):
        u = nibble_coarse_bounds(q, t["lo"], t["scale"], t["radius"], codes, low_bits=low_bits)
        assert bool((exact <= u).all()), f"{8 - low_bits} high bits"
        slack.append(float((u - exact).mean()))
    assert all(b < a for a, b in zip(slack, slack[1:])), slack


def _grid(keys, dtype=torch.float16):
    store = PageIndexStore(LouverConfig(page_size=P, grid_bits=8), keys.shape[0] // P, H_KV, keys.shape[2], dtype)
    store.build_pages(keys, torch.arange(store.num_pages))
    return store.tensors, unpack_codes(store.page_codes(torch.arange(store.num_pages)), 8)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_allocated_bits_bound_every_key(seed, dtype):
    """Per-channel unread bits (the allocated designs): a random allocation and the tiers of
    ``allocate_low_bits`` with calibrated weights each bound every key, and each tier (more bits
    read) tightens the mean bound."""
    dim = 32
    keys = _keys(seed, dim, dtype)
    t, codes = _grid(keys, dtype)
    q = _queries(seed, dim)
    exact = _exact(q, keys).view(-1, P, H_KV, G)
    random_low = torch.randint(0, 9, t["scale"].shape, generator=torch.Generator().manual_seed(seed))
    u = nibble_coarse_bounds(q, t["lo"], t["scale"], t["radius"], codes, low_bits=random_low)
    assert bool(torch.isfinite(u).all()) and bool((exact <= u).all()), "random allocation"
    weight = calibrate_channel_weights(torch.randn(20, H_KV * G, dim, generator=torch.Generator().manual_seed(seed)),
                                       H_KV)
    slack = []
    for budget, low in zip((16, 48, 96, 160, 255), allocate_low_bits(t["scale"], weight, (16, 48, 96, 160, 255))):
        u = nibble_coarse_bounds(q, t["lo"], t["scale"], t["radius"], codes, low_bits=low)
        assert bool((exact <= u).all()), f"{budget} bits per token"
        slack.append(float((u - exact).mean()))
    assert all(b < a for a, b in zip(slack, slack[1:])), slack


def test_allocation_spends_each_budget_high_bits_first():
    dim = 32
    t, _ = _grid(_keys(0, dim))
    scale = t["scale"]
    weight = torch.rand(H_KV, dim, generator=torch.Generator().manual_seed(3)) + 0.1
    weight[:, 5] = 0.0  # a channel no query uses: read last
    budgets = (1, 40, 128, 200, 8 * (dim - 1))
    lows = allocate_low_bits(scale, weight, budgets)
    for budget, low in zip(budgets, lows):
        assert low.shape == scale.shape and bool(((low >= 0) & (low <= 8)).all())
        assert bool(((8 - low).sum(-1) == budget).all()), budget
    assert all(bool((b <= a).all()) for a, b in zip(lows, lows[1:])), "tiers are nested"
    first = (scale.double().abs() * weight[None]).argmax(-1)  # [n, H_kv]: the largest weighted spread
    assert bool((lows[0].argmin(-1) == first).all()) and bool((lows[0].amin(-1) == 7).all())
    assert bool((lows[-1][..., 5] == 8).all()), "the zero-weight channel gets no bit"


def test_allocation_and_bounds_reject_bad_input():
    dim = 32
    t, codes = _grid(_keys(0, dim))
    ones = torch.ones(H_KV, dim)
    with pytest.raises(ValueError, match="weight"):
        allocate_low_bits(t["scale"], torch.ones(H_KV + 1, dim), (8,))
    with pytest.raises(ValueError, match="budgets"):
        allocate_low_bits(t["scale"], ones, (64, 32))
    with pytest.raises(ValueError, match="budgets"):
        allocate_low_bits(t["scale"], ones, (8 * dim + 1,))
    with pytest.raises(ValueError, match="low_bits"):
        nibble_coarse_bounds(_queries(0, dim), t["lo"], t["scale"], t["radius"], codes, low_bits=9)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("block", [4, 8])
def test_block_min_max_bounds_every_key_of_its_block(seed, block):
    dim = 32
    keys = _keys(seed, dim)
    lo, hi = block_minmax(keys, block)
    q = _queries(seed, dim)
    u = block_minmax_bounds(q, lo, hi)  # [nb, H_kv, G]
    exact = _exact(q, keys).view(-1, block, H_KV, G)
    assert bool((exact <= u[:, None]).all())


def test_fp16_rounding_is_on_the_safe_side():
    x = torch.tensor([1.0 + 1e-4, -1.0 - 1e-4, 7e4, -7e4, 1e-9, math.nan], dtype=torch.float64)
    down, up = round_to_fp16(x, down=True), round_to_fp16(x, down=False)
    finite = ~torch.isnan(x)
    assert bool((down[finite] <= x[finite]).all()) and bool((up[finite] >= x[finite]).all())
    assert up[2] == math.inf and down[3] == -math.inf and bool(torch.isnan(up[5]))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("rank", [4, 16])
def test_the_low_rank_bound_holds_for_any_projection(seed, rank):
    """A projection calibrated on other keys, and a random non-orthonormal one: the bound holds."""
    dim = 32
    keys, other = _keys(seed, dim), _keys(seed + 7, dim)
    q = _queries(seed, dim)
    for proj in (calibrate_projection(other, rank),
                 torch.randn(H_KV, rank, dim, generator=torch.Generator().manual_seed(seed)) * 0.3):
        kt, r_k, delta = lowrank_terms(keys, proj)
        pq = project_queries(q, proj)
        store = PageIndexStore(LouverConfig(page_size=P, grid_bits=8), keys.shape[0] // P, H_KV, rank, torch.float32)
        store.build_pages(kt, torch.arange(store.num_pages))
        ids = torch.arange(store.num_pages)
        rows = pq.view(1, H_KV, G, rank).expand(len(ids), -1, -1, -1).contiguous()
        projected = store.token_bounds(store.page_bounds(rows, ids), ids).reshape(-1, H_KV, G)
        u = lowrank_bounds(q, proj, projected, kt, r_k, delta)
        assert bool((_exact(q, keys) <= u).all())


def test_non_finite_keys_keep_and_ties_keep():
    """A NaN or infinite key: its bound is NaN or +inf (kept at any T); a key whose exact score
    equals T is kept (~(u < T))."""
    dim = 32
    keys = _keys(0, dim)
    keys[5, 0, 4] = math.nan
    keys[P + 2, 1, 6] = math.inf
    lo, hi = block_minmax(keys, 8)
    q = _queries(0, dim)
    u = block_minmax_bounds(q, lo, hi)
    assert bool(torch.isnan(u[0, 0]).all()) and bool((u[P // 8 * 1 + 0, 1] == math.inf).any() | torch.isnan(u[2, 1]).any())
    store = PageIndexStore(LouverConfig(page_size=P, grid_bits=8), keys.shape[0] // P, H_KV, dim, torch.float32)
    store.build_pages(keys, torch.arange(store.num_pages))
    t = store.tensors
    nib = nibble_coarse_bounds(q, t["lo"], t["scale"], t["radius"],
                               unpack_codes(store.page_codes(torch.arange(store.num_pages)), 8))
    assert bool((~(nib[0, :, 0] < 1e30)).all()), "the NaN key's page keeps every token"
    low = allocate_low_bits(t["scale"], torch.ones(H_KV, dim), (40,))[0]
    nib = nibble_coarse_bounds(q, t["lo"], t["scale"], t["radius"],
                               unpack_codes(store.page_codes(torch.arange(store.num_pages)), 8), low_bits=low)
    assert bool((~(nib[0, :, 0] < 1e30)).all()), "with allocated bits too"
    clean = _keys(1, dim)
    lo, hi = block_minmax(clean, 8)
    u = block_minmax_bounds(q, lo, hi)
    exact = _exact(q, clean).view(-1, 8, H_KV, G)
    tie = exact.amax(1)  # T = the block's best exact score
    assert bool((~(u < tie)).all())
