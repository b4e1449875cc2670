"""The bytes study's accounting (``benchmarks/studies/index_bytes.py``): plane reads counted in
whole memory sectors, and a small end-to-end run whose recall is 1.0 for every design."""

from __future__ import annotations

import torch

from benchmarks.studies.index_bytes import sector_bytes


def test_plane_reads_count_whole_sectors():
    tokens = torch.zeros(2, 8, 1, dtype=torch.bool)
    tokens[0, 2, 0] = True
    assert sector_bytes(tokens, 4) == 32  # 8 tokens of 4 bytes share one sector
    assert sector_bytes(tokens, 12) == 64  # bytes 24-35 straddle two sectors
    assert sector_bytes(tokens, 64) == 64
    tokens[0, 3, 0] = True  # bytes 36-47: the second sector again
    assert sector_bytes(tokens, 12) == 64
    tokens[1, 7, 0] = True  # another page: its own sectors
    assert sector_bytes(tokens, 12) == 96
    heads = torch.zeros(1, 8, 2, dtype=torch.bool)
    heads[0, 0, 0] = heads[0, 0, 1] = True  # each KV head has its own plane
    assert sector_bytes(heads, 4) == 64
    assert sector_bytes(torch.ones(3, 16, 2, dtype=torch.bool), 6) == 3 * 2 * 96


def test_every_design_keeps_every_key_that_reaches_t_on_random_keys():
    """Every design and policy on synthetic keys (2,048 tokens, 2 KV heads, groups of 3, D = 64):
    recall 1.0; sectors never count fewer bytes than tokens; planes and tiers report the share
    that read past their first one."""
    from benchmarks.studies.index_bytes import PARTS, designs_for, measure_query
    from louver_sgl import LouverConfig
    from louver_sgl.decode.plan import split_pages
    from louver_sgl.index.bound_designs import calibrate_channel_weights

    gen = torch.Generator().manual_seed(0)
    n, h_kv, groups, dim = 2048, 2, 3, 64
    keys = (torch.randn(n, h_kv, dim, generator=gen) * torch.linspace(0.2, 3.0, dim)).to(torch.float16)
    q = torch.randn(h_kv * groups, dim, generator=gen)
    weights = calibrate_channel_weights(torch.randn(8, h_kv * groups, dim, generator=gen), h_kv)
    idx64 = split_pages(n, LouverConfig(page_size=64))[1]
    idx128 = split_pages(n, LouverConfig(page_size=128))[1]
    designs = designs_for(keys, q, idx64, idx128, {}, weights)
    assert {"grid8-p128", "split2+2+4-p128", "allocq9r-p128", "allocq6-p128"} <= set(designs)
    for name, (bounds, idx, page) in designs.items():
        for policy, r in measure_query(keys, q, 0.125, name, bounds, idx, page, 256).items():
            assert r["recall_ok"], (name, policy)
            assert set(r["parts"]) == set(PARTS)
            assert r["plane_sectors"] >= r["parts"]["planes"] - 1e-6, (name, policy)
            has_planes = hasattr(bounds, "prefixes")
            assert (r["past_first"][1] > 0) == has_planes, (name, policy)
