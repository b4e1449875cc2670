"""The GPU benchmark's speed-of-light kernels against their plain-torch references (under the
Triton interpreter on CPU; natively on a GPU)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks import gpu_sol  # noqa: E402
from conftest import make_paged  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("bits", [8, 4])
def test_the_code_scan_sums_what_its_reference_sums(bits):
    lens, page, h_kv, dim = [300, 129], 16, 2, 64
    k, _, table, seq = make_paged(lens, page, h_kv, dim, seed=1)
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 256, (len(k), h_kv, dim * bits // 8), generator=gen, dtype=torch.uint8)
    weights = torch.randint(-127, 128, (16, dim), generator=gen).to(torch.float16)
    n_tiles = -(-table.shape[1] // 4)
    out = torch.empty(len(lens), h_kv, n_tiles, device=DEVICE)
    gpu_sol.code_scan(table.to(DEVICE), seq.to(DEVICE), codes.to(DEVICE), weights.to(DEVICE), out, page, bits, 4)
    want = gpu_sol.code_scan_reference(table, seq, codes, weights, page, bits, 4, n_tiles)
    torch.testing.assert_close(out.cpu().double(), want, atol=0, rtol=1e-6)


def test_folded_lists_name_the_same_rows_twice():
    lens, page, h_kv = [300, 129], 16, 3
    _, _, table, seq = make_paged(lens, page, h_kv, 8, seed=0)
    (indptr, indices), lists = gpu_sol.folded_lists(table, seq, h_kv, page, 0.125, table.shape[1] * page)
    for b, n in enumerate(lens):
        for h in range(h_kv):
            row = b * h_kv + h
            folded = indices[indptr[row]:indptr[row + 1]]
            count = int(lists["total"][b, h])
            assert count == round(0.125 * n) == len(folded)
            assert torch.equal(folded, lists["slot"][b, h, :count] * h_kv + h)
            pos = torch.arange(n)
            slots = table[b, pos // page].long() * page + pos % page
            assert bool(torch.isin(lists["slot"][b, h, :count].long(), slots).all())
