"""The memory-floor benchmark's read loop against its torch reference, and its access pattern."""

import pytest
import torch

from conftest import skip_or_fail

from benchmarks.cpu.memory_floor_cpu import access_pattern, touch_ops, touch_reference
from louver_sgl import LouverConfig, PageIndexStore
from louver_sgl.decode import louver_decode
from louver_sgl.decode.plan import plan_decode


@pytest.fixture(scope="module")
def ops():
    try:
        return touch_ops()
    except Exception as exc:  # no compiler: the benchmark cannot run either (on CI: a failure)
        skip_or_fail(f"cannot build the read loop: {exc}")


@pytest.mark.slow  # the read loop's build: 45 s on two cores, for a benchmark's tool
def test_touch_matches_reference(ops):
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (64, 3, 32), dtype=torch.uint8, generator=gen)
    k = torch.randn(64, 3, 64, generator=gen).half()
    v = torch.randn(64, 3, 64, generator=gen).half()
    pages = torch.tensor([3, 0, 2])
    k_rows, v_rows = torch.tensor([5, 17, 40, 41, 100, 191]), torch.tensor([17, 100])
    args = (codes, pages, 16 * 3 * 32, k_rows, v_rows, k, v, 128)
    assert ops.touch(*args) % 2**32 == touch_reference(*args)
    # every line counts: changing one byte of a read row changes the sum
    k.view(torch.uint8).view(-1)[40 * 128] ^= 1
    assert ops.touch(*args) % 2**32 == touch_reference(*args)


def test_access_pattern_counts_and_order():
    gen = torch.Generator().manual_seed(1)
    cfg = LouverConfig(family="grid", grid_bits=4, page_size=16, policy="budget", budget=0.1, sink_pages=0)
    n_pages, h_kv, d = 12, 2, 64
    k = torch.randn(n_pages * 16, h_kv, d, generator=gen).half()
    v = torch.randn(n_pages * 16, h_kv, d, generator=gen).half()
    q = torch.randn(1, 4, d, generator=gen)
    table = torch.randperm(n_pages, generator=gen)[None]
    lens = torch.tensor([n_pages * 16 - 5])
    store = PageIndexStore(cfg, n_pages, h_kv, d, k.dtype)
    plan = plan_decode(table, lens, cfg)
    store.build_pages(k, plan.page_ids)
    _, stats = louver_decode(q, k, v, table, lens, store, 0.125, impl="torch")
    pages, k_rows, v_rows = access_pattern(stats, store, plan)
    assert len(pages) == int(stats.pages_read.sum()) and len(k_rows) > 0
    assert len(k_rows) == int(stats.union_candidates.sum()) and len(v_rows) == int(stats.values_read.sum())
    assert set(v_rows.tolist()) <= set(k_rows.tolist())
    page_of = lambda rows: (rows // h_kv) // 16
    order = {int(p): i for i, p in enumerate(plan.page_ids)}
    ranks = [order[int(p)] for p in page_of(k_rows)]
    assert ranks == sorted(ranks) and set(ranks) <= set(range(len(plan.page_ids)))
