"""The provisional-threshold study's att-est level and GQA-union count (benchmarks/studies)."""

from __future__ import annotations

import math

import torch

from benchmarks.studies.provisional_threshold import attended_level, union_kept


def _fits(scores, level, ref, z_dense, n, sigma, budget):
    mass = torch.exp(sigma * (scores.double() - ref)) * (n / len(scores))
    return float(mass[scores < level].sum()) <= budget * (z_dense + float(mass[scores >= level].sum()))


def test_attended_level_is_the_highest_sample_score_that_fits():
    torch.manual_seed(0)
    sigma, n, budget = 0.125, 4096, 0.01
    for _ in range(20):
        scores = torch.randn(64, 1) * 20
        ref, z_dense = scores.max(0).values, torch.tensor([float(torch.rand(1)) * 3])
        level = float(attended_level(ref, z_dense, scores, n, sigma, budget, 1.0)[0])
        col = scores[:, 0]
        assert level in col.tolist() and _fits(col, level, float(ref), float(z_dense), n, sigma, budget)
        higher = col[col > level]
        assert all(not _fits(col, float(h), float(ref), float(z_dense), n, sigma, budget) for h in higher)


def test_attended_level_never_drops_below_the_lowest_sample_score():
    """The lowest sample score drops nothing of the sample, so it always fits: a flat head's level
    is that score (the shipped level then floors it), never above it."""
    scores = torch.zeros(8, 1)
    scores[0] = 1.0
    level = attended_level(scores.max(0).values, torch.zeros(1), scores, 1000, 1.0, 1e-9, 1.0)
    assert float(level[0]) == 0.0


def test_union_kept_counts_each_group_row_once():
    pb = torch.full((1, 4), 10.0)  # one page (its bound keeps it), 4 heads in 2 groups of 2
    tb = torch.tensor([[[0.0, 1.0, 5.0, 5.0], [2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]])  # [1, 3, 4]
    t = torch.tensor([1.0, 1.0, 1.0, 6.0])
    union = union_kept(pb, tb, t, 2)
    assert union.tolist() == [2, 1]  # group 0: rows 0 and 1; group 1: row 0 (head 2 only)
