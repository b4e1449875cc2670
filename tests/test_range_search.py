"""Zero false negatives of ``LouverIndex.range_search`` against an fp64 brute force."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import assert_no_false_negatives, brute_force_scores
from louver_sgl import LouverConfig, LouverIndex
from louver_sgl.index.numerics import round_down

CONFIGS = [
    LouverConfig(page_size=16, family="grid", grid_bits=2),
    LouverConfig(page_size=16, family="grid", grid_bits=4),
    LouverConfig(page_size=32, family="grid", grid_bits=8),
    LouverConfig(page_size=16, family="clustered", n_subspaces=8, cluster_size=4),
    LouverConfig(page_size=32, family="clustered", n_subspaces=16, cluster_size=2, residual_norms=True),
    LouverConfig(page_size=16, family="clustered", n_subspaces=4, cluster_size=8),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GQA = [(1, 1), (2, 4), (4, 1), (1, 8), (3, 3)]


def _keys(gen, n, h_kv, dim, dtype, scale, kind):
    k = torch.randn(n, h_kv, dim, generator=gen) * scale
    if kind == "duplicates":
        k[1::2] = k[0::2][: len(k[1::2])]
    elif kind == "constant_channels":
        k[..., ::3] = 1.5
    elif kind == "outliers":
        k[:: max(1, n // 7)] *= 50.0
    limit = 60000.0 if dtype == torch.float16 else 1e30
    return k.clamp(-limit, limit).to(dtype)


def _thresholds(scores: torch.Tensor, mode: str, gen) -> torch.Tensor:
    h_q = scores.shape[0]
    if mode == "-inf":
        return torch.full((h_q,), -math.inf)
    if mode == "+inf":
        return torch.full((h_q,), math.inf)
    if mode == "tie":  # exactly an existing score (rounded down so the key must be kept)
        pick = torch.randint(0, scores.shape[1], (h_q,), generator=gen)
        return round_down(scores[torch.arange(h_q), pick], torch.float32)
    top = scores.max(dim=1).values
    if mode == "max_below":
        return round_down(top, torch.float32)
    if mode == "max_above":
        return torch.nextafter(top.float(), torch.full((h_q,), math.inf))
    quantile = {"q50": 0.5, "q90": 0.9, "q99": 0.99}[mode]
    return scores.quantile(quantile, dim=1).float()


@given(
    config_i=st.integers(0, len(CONFIGS) - 1),
    dtype_i=st.integers(0, len(DTYPES) - 1),
    gqa_i=st.integers(0, len(GQA) - 1),
    dim=st.sampled_from([64, 128]),
    n=st.integers(1, 300),
    scale=st.sampled_from([1e-3, 1.0, 30.0, 3000.0]),
    q_scale=st.sampled_from([0.0, 1e-30, 1e-3, 1.0, 100.0]),
    kind=st.sampled_from(["gauss", "duplicates", "constant_channels", "outliers"]),
    mode=st.sampled_from(["-inf", "+inf", "tie", "max_below", "max_above", "q50", "q90", "q99"]),
    seed=st.integers(0, 2**16),
)
def test_range_search_has_no_false_negatives(config_i, dtype_i, gqa_i, dim, n, scale, q_scale, kind, mode, seed):
    """Every key with exact (fp64) q·k >= T is returned, for adversarial inputs."""
    gen = torch.Generator().manual_seed(seed)
    h_kv, groups = GQA[gqa_i]
    keys = _keys(gen, n, h_kv, dim, DTYPES[dtype_i], scale, kind)
    queries = (torch.randn(h_kv * groups, dim, generator=gen) * q_scale).to(DTYPES[dtype_i])
    index = LouverIndex.build(keys, CONFIGS[config_i])
    scores = brute_force_scores(queries, keys)
    thresholds = _thresholds(scores, mode, gen)
    mask = index.range_search(queries, thresholds)
    assert mask.shape == (h_kv * groups, n) and mask.dtype == torch.bool
    assert_no_false_negatives(mask, scores, thresholds)
    if mode == "-inf":
        assert bool(mask.all())


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.family}-{c.grid_bits}-{c.n_subspaces}")
def test_every_exact_score_as_threshold(config):
    """Ties: T equal to each key's own score keeps that key (all keys, all heads)."""
    gen = torch.Generator().manual_seed(7)
    keys = torch.randn(96, 2, 64, generator=gen).to(torch.float16)
    queries = torch.randn(4, 64, generator=gen)
    index = LouverIndex.build(keys, config)
    scores = brute_force_scores(queries, keys)
    for i in range(0, 96, 5):
        t = round_down(scores[:, i], torch.float32)
        assert bool(index.range_search(queries, t)[:, i].all())


def test_nonfinite_keys_are_kept():
    """NaN/Inf in a page makes its bounds NaN/Inf, which means keep, never drop."""
    keys = torch.randn(64, 1, 64)
    keys[5, 0, 3] = float("nan")
    keys[40, 0, 0] = float("inf")
    for config in CONFIGS[:1] + CONFIGS[3:4]:
        index = LouverIndex.build(keys, config.with_(page_size=16))
        mask = index.range_search(torch.randn(2, 64), torch.tensor([1e6, 1e6]))
        assert bool(mask[:, :16].all()) and bool(mask[:, 32:48].all())


def test_pruning_happens_on_structured_keys():
    """The filter is not vacuous: on clustered keys a high threshold drops most keys."""
    gen = torch.Generator().manual_seed(3)
    centers = torch.randn(8, 1, 64, generator=gen) * 4
    keys = centers.repeat(64, 1, 1) + 0.1 * torch.randn(512, 1, 64, generator=gen)
    queries = centers[0]
    index = LouverIndex.build(keys, LouverConfig(page_size=64, family="grid", grid_bits=8))
    scores = brute_force_scores(queries, keys)
    t = scores.quantile(0.95, dim=1).float()
    mask = index.range_search(queries, t)
    assert_no_false_negatives(mask, scores, t)
    assert mask.float().mean() < 0.5
