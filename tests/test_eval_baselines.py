"""Comparison policies (oracle top-k, Quest, StreamingLLM) and masked fp64 attention."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import brute_force_scores
from louver_sgl import LouverConfig
from louver_eval.baselines import baseline_attended, dense_part_mask, masked_attention

CFG = LouverConfig(page_size=16)


def _data(n=300, h_kv=2, groups=3, dim=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(n, h_kv, dim, generator=gen)
    keys[:, :, :4] += 3 * torch.randn(n, h_kv, 1, generator=gen)
    return torch.randn(h_kv * groups, dim, generator=gen), keys, torch.randn(n, h_kv, dim, generator=gen)


def test_dense_part_is_sink_recent_and_tail():
    mask, indexed = dense_part_mask(300, 2, CFG)  # 18 full pages + 12-token tail
    assert indexed == range(16, 17 * 16)
    assert bool(mask[:, :16].all()) and bool(mask[:, 17 * 16:].all()) and not bool(mask[:, 16:17 * 16].any())


def test_oracle_topk_keeps_the_k_best_indexed_keys():
    q, keys, _ = _data()
    mask = baseline_attended("oracle_topk", q, keys, 0.1, CFG)
    indexed = range(16, 272)
    k = round(0.1 * len(indexed))
    scores = brute_force_scores(q, keys)[:, 16:272]
    chosen = mask[:, 16:272]
    assert bool((chosen.sum(1) == k).all())
    worst_kept = torch.where(chosen, scores, math.inf).amin(1)
    best_dropped = torch.where(chosen, -math.inf, scores).amax(1)
    assert bool((worst_kept >= best_dropped).all())


def test_quest_page_bound_is_sound_and_selects_whole_best_pages():
    q, keys, _ = _data(seed=1)
    mask = baseline_attended("quest", q, keys, 0.2, CFG)
    chosen = mask[:, 16:272].view(6, 16, 16)  # [H_q, pages, P]
    assert bool((chosen.all(-1) | ~chosen.any(-1)).all()), "Quest attends whole pages"
    assert bool((chosen.all(-1).sum(1) == math.ceil(round(0.2 * 256) / 16)).all())
    paged = keys[16:272].view(16, 16, 2, -1).repeat_interleave(3, dim=2)  # [pages, P, H_q, D]
    bound = torch.maximum(q * paged.amin(1), q * paged.amax(1)).sum(-1)  # [pages, H_q]
    exact = torch.einsum("hd,pthd->pth", q, paged).amax(1)
    assert bool((bound >= exact - 1e-5).all()), "the min/max bound upper-bounds every page score"


def test_streaming_keeps_the_most_recent_indexed_keys():
    q, keys, _ = _data()
    mask = baseline_attended("streaming", q, keys, 0.25, CFG)
    assert bool(mask[:, 272 - 64:].all()) and not bool(mask[:, 16:272 - 64].any())


@pytest.mark.parametrize("method", ["oracle_topk", "quest", "streaming"])
def test_fraction_limits(method):
    q, keys, _ = _data()
    dense, _ = dense_part_mask(300, 6, CFG)
    assert torch.equal(baseline_attended(method, q, keys, 0.0, CFG), dense)
    assert bool(baseline_attended(method, q, keys, 1.0, CFG).all())


def test_bad_input_is_rejected():
    q, keys, _ = _data()
    with pytest.raises(ValueError, match="unknown baseline"):
        baseline_attended("h2o", q, keys, 0.1, CFG)
    with pytest.raises(ValueError, match="fraction"):
        baseline_attended("quest", q, keys, 1.5, CFG)


def test_masked_attention_dense_and_dropped_mass():
    q, keys, values = _data()
    full = torch.ones(6, 300, dtype=torch.bool)
    out, dropped = masked_attention(q, keys, values, full, 0.2)
    p = torch.softmax(0.2 * brute_force_scores(q, keys), dim=1)
    want = torch.einsum("hl,lhd->hd", p, values.double().repeat_interleave(3, dim=1))
    torch.testing.assert_close(out, want)
    assert bool((dropped == 0).all())
    half = full.clone()
    half[:, 150:] = False
    _, dropped = masked_attention(q, keys, values, half, 0.2)
    torch.testing.assert_close(dropped, p[:, 150:].sum(1))
