"""The shared-scale grid study's bounds (benchmarks/studies/shared_scale_grid.py)."""

from __future__ import annotations

import torch

from benchmarks.studies.shared_scale_grid import grid_bounds, kept_over_oracle


def test_grid_bounds_bound_every_key_on_each_grid():
    """centre·q + deviation·|q| >= k·q in fp64 for every key, on a page's own range, on a shared
    range, and on a range too narrow for some keys (clamped codes, larger deviations)."""
    torch.manual_seed(0)
    keys = torch.randn(4, 16, 2, 8, dtype=torch.float64) * torch.tensor([1.0, 5.0]).view(1, 1, 2, 1)
    page_lo, page_hi = keys.amin(1), keys.amax(1)
    ranges = {"page": (page_lo, page_hi), "shared": (keys.amin((0, 1)).expand_as(page_lo), keys.amax((0, 1)).expand_as(page_hi)),
              "narrow": (page_lo * 0.5, page_hi * 0.5)}
    for name, (lo, hi) in ranges.items():
        centre, dev = grid_bounds(keys, lo, hi, bits=4)
        for _ in range(10):
            q = torch.randn(8, dtype=torch.float64)
            bound = (centre @ q) + (dev @ q.abs()).unsqueeze(1)
            assert bool(((keys @ q) <= bound + 1e-12).all()), name


def test_kept_over_oracle_is_at_least_one_and_the_page_grid_tightest_on_drifting_keys():
    """Every grid keeps at least the oracle's keys (the bounds are sound); on keys whose range
    drifts along the context, per-page ranges keep fewer than one shared range, and a range
    taken from the first tokens alone (clamped) keeps the most."""
    torch.manual_seed(1)
    n, heads, dim = 2048, 1, 8
    drift = torch.linspace(0, 6, n, dtype=torch.float64).view(n, 1, 1)
    keys = torch.randn(n, heads, dim, dtype=torch.float64) + drift * torch.randn(1, heads, dim, dtype=torch.float64)
    queries = torch.randn(3, 2, dim, dtype=torch.float64)
    kept = kept_over_oracle(keys, queries, page_size=64, bits=8, calibration=256)
    assert min(kept.values()) >= 1.0
    assert kept["page"] <= kept["shared"] <= kept["calibrated"]
