"""``min_sparse_tokens``: the tuned minimum context length of the sparse path."""

from __future__ import annotations

import pytest
import torch

from conftest import make_paged
from louver_sgl import LouverConfig, PageIndexStore
from louver_sgl.decode import louver_decode
from louver_sgl.decode.plan import split_pages
from louver_sgl.decode.impl_torch import dense_attention


def test_split_pages_below_and_above_the_minimum():
    config = LouverConfig(min_sparse_tokens=1000)
    assert split_pages(999, config) == (range(0, 15), range(15, 15), range(15, 15))
    assert split_pages(1000, config) == (range(0, 1), range(1, 14), range(14, 15))


def test_invalid_minimum_is_rejected():
    with pytest.raises(ValueError, match="min_sparse_tokens"):
        LouverConfig(min_sparse_tokens=-1)


@pytest.mark.parametrize("impl", ["torch", "cpu"])
def test_short_requests_attend_densely(impl):
    """A request below the minimum reads no index and equals dense attention; a longer one in the
    same batch still goes through the index."""
    config = LouverConfig(min_sparse_tokens=600, eps=1e-2)
    k, v, table, lens = make_paged([500, 900], config.page_size, 2, 32, seed=3)
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(1))
    store = PageIndexStore(config, len(k) // config.page_size, 2, 32, k.dtype)
    store.build_pages(k, torch.arange(store.num_pages))
    out, stats = louver_decode(q, k, v, table, lens, store, 32 ** -0.5, impl=impl)
    assert int(stats.num_indexed[0]) == 0 and int(stats.num_indexed[1]) > 0
    pos = torch.arange(500)
    slots = table[0, pos // 64] * 64 + pos % 64
    torch.testing.assert_close(out[0], dense_attention(q[0], k[slots], v[slots], 32 ** -0.5), rtol=1e-5, atol=1e-5)
