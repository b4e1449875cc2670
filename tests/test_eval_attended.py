"""The attended key sets the evaluations read (``LouverDecode.run(..., attended=True)``): the
specification's sets, with the same output and statistics as a step without them."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import brute_force_scores, make_paged
from louver_sgl import LouverConfig, PageIndexStore
from louver_sgl.decode import LouverDecode, louver_decode
from louver_sgl.decode.reference import reference_decode

LENS = [300, 700, 20, 64, 129]


def _setup(config, h_kv=2, groups=3, dim=64, seed=0):
    k, v, table, seq_lens = make_paged(LENS, config.page_size, h_kv, dim, seed=seed)
    store = PageIndexStore(config, len(k) // config.page_size, h_kv, dim, k.dtype)
    store.build_pages(k, torch.arange(store.num_pages))
    q = torch.randn(len(LENS), h_kv * groups, dim, generator=torch.Generator().manual_seed(seed + 1)) * 2
    return q, k, v, table, seq_lens, store


POLICIES = [dict(policy="certified", eps=0.05), dict(policy="certified", eps=1e-4),
            dict(policy="budget", budget=0.1), dict(policy="budget", budget=0.1, value_gate=False),
            dict(policy="fixed", fixed_threshold=4.0), dict(policy="certified", eps=0.05, dense_fallback_fraction=0.2)]


@pytest.mark.parametrize("options", POLICIES, ids=lambda o: "-".join(f"{v}" for v in o.values()))
def test_matches_real_step_and_reference(options):
    """Output and stats equal the step's without the sets exactly; attended sets equal the reference's."""
    cfg = LouverConfig(page_size=16, sample_size=32, **options)
    q, k, v, table, lens, store = _setup(cfg)
    sigma = 1 / math.sqrt(64)
    want, want_stats = louver_decode(q, k, v, table, lens, store, sigma, impl="torch")
    step_result = LouverDecode(cfg, impl="torch").plan(table, lens).run(q, k, v, store, sigma, attended=True)
    out, stats, attended = step_result.out, step_result.stats, step_result.attended
    assert torch.equal(out, want)
    for field in ("threshold", "candidates", "pages_skipped", "mass_bound", "dense_fallback"):
        assert torch.equal(getattr(stats, field), getattr(want_stats, field)), field
    _, info = reference_decode(q, k, v, table, lens, store, sigma)
    for b in range(len(LENS)):
        assert attended[b].shape == (q.shape[1], int(lens[b]))
        assert torch.equal(attended[b], info[b]["attended"]), b


def test_attended_set_has_every_key_at_or_above_t():
    """Recall 1.0 against fp64 scores, the invariant the exactness evaluation checks at scale."""
    cfg = LouverConfig(page_size=16, sample_size=32, policy="budget", budget=0.05)
    q, k, v, table, lens, store = _setup(cfg, seed=3)
    step_result = LouverDecode(cfg, impl="torch").plan(table, lens).run(q, k, v, store, 0.125, attended=True)
    stats, attended = step_result.stats, step_result.attended
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        scores = brute_force_scores(q[b], k[table[b, pos // 16] * 16 + pos % 16])
        must = scores >= stats.threshold[b].double()[:, None]
        assert not bool((must & ~attended[b]).any())
        assert bool((~attended[b]).any()) or n <= 48  # the policy did drop keys
