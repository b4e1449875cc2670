"""Exactness and the certified bound on real SmolLM2 queries and keys (captured offline).

The traces are produced by ``python -m louver_eval.data.capture`` (``scripts/test.sh`` runs it
before the tests; the fixture captures them itself if they are missing).
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_no_false_negatives, brute_force_scores, needs_impl
from louver_sgl import LouverConfig, LouverIndex, PageIndexStore
from louver_eval.data.capture import ensure_traces, load_trace
from louver_eval.data.paged import paged_batch
from louver_sgl.decode import LouverDecode
from louver_sgl.index.numerics import round_down

CONFIGS = [
    LouverConfig(family="grid", grid_bits=8),
    LouverConfig(family="grid", grid_bits=4),
    LouverConfig(family="grid", grid_bits=2, page_size=32),
    LouverConfig(family="clustered", n_subspaces=16, cluster_size=4),
    LouverConfig(family="clustered", n_subspaces=8, cluster_size=4, residual_norms=True),
]


@pytest.fixture(scope="module", params=["bible", "paul_graham"])
def trace(request):
    (path,) = ensure_traces([2048], text=request.param)
    return load_trace(path)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.family}-{c.grid_bits}-{c.n_subspaces}")
def test_range_search_exact_on_real_traces(trace, config):
    """Recall exactly 1.0 vs fp64 on every captured layer and query, at several thresholds."""
    for layer, keys in trace["keys"].items():
        queries = trace["queries"][layer]
        index = LouverIndex.build(keys, config)
        for qi in range(0, len(queries), 5):
            q = queries[qi]
            scores = brute_force_scores(q, keys)
            for t in (scores.quantile(0.99, dim=1).float(), scores.quantile(0.9, dim=1).float(),
                      round_down(scores.max(dim=1).values, torch.float32),
                      round_down(scores[:, 1000], torch.float32)):
                assert_no_false_negatives(index.range_search(q, t), scores, t)


@pytest.mark.parametrize("impl", ["torch", "cpu"])
@pytest.mark.parametrize("eps", [1e-2, 1e-3])
def test_certified_bound_on_real_traces(trace, impl, eps):
    """Measured dropped mass <= certified bound < eps on real attention, every layer, on the key
    set the implementation itself attended (the compiled step's from its attend pass). The dense
    fallback is off, so every request takes the sparse path and is checked."""
    needs_impl(impl)
    config = LouverConfig(eps=eps, dense_fallback_fraction=1.0)
    pruned = 0
    for layer in trace["keys"]:
        pb = paged_batch(trace, layer, 2, config.page_size)
        store = PageIndexStore(config, len(pb.k) // config.page_size, pb.k.shape[1], pb.k.shape[2], pb.k.dtype)
        store.build_pages(pb.k, torch.arange(store.num_pages))
        decode = LouverDecode(config, "cpu", impl=impl).plan(pb.page_table, pb.seq_lens)
        step_result = decode.run(pb.q, pb.k, pb.v, store, pb.sigma, attended=True)
        stats, attended = step_result.stats, step_result.attended
        assert bool((stats.mass_bound < eps).all())
        assert not bool(stats.dense_fallback.any()) and bool((stats.num_indexed > 0).all()), "not on the sparse path"
        counts = torch.stack([m.sum(1) for m in attended]) - (pb.seq_lens - stats.num_indexed)[:, None]
        assert torch.equal(counts, stats.candidates), "counts differ from the attended set"
        for b in range(2):
            n = int(pb.seq_lens[b])
            pos = torch.arange(n)
            slots = pb.page_table[b, pos // config.page_size] * config.page_size + pos % config.page_size
            s = pb.sigma * brute_force_scores(pb.q[b], pb.k[slots])
            scores = s / pb.sigma
            assert not bool(((scores >= stats.threshold[b].double()[:, None]) & ~attended[b]).any()), "recall < 1"
            dropped = (torch.softmax(s, dim=1) * ~attended[b]).sum(1)
            assert bool((dropped <= stats.mass_bound[b] + 1e-12).all())
            pruned += int((~attended[b]).sum())
    assert pruned > 0, "nothing was pruned: the check is vacuous"
