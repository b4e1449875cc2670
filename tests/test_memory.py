"""Huge-page placement of large CPU buffers: contents never change; the memory is backed by huge
pages where the kernel offers them."""

import pytest
import torch

from louver_eval.data.paged import paged_batch
from louver_sgl.memory import (HUGE_PAGE_BYTES, advise_huge_pages, huge_copy, huge_page_bytes,
                               huge_pages_available, huge_zeros)
from test_tune_study import synthetic_trace

needs_thp = pytest.mark.skipif(not huge_pages_available(), reason="no transparent huge pages here")


def test_advise_keeps_contents_and_reports_the_aligned_interior():
    t = torch.randn(5 * HUGE_PAGE_BYTES // 4)  # 10 MiB of fp32
    want = t.clone()
    advised = advise_huge_pages(t)
    assert torch.equal(t, want)
    assert advised % HUGE_PAGE_BYTES == 0 and advised <= t.numel() * 4
    if huge_pages_available():
        assert advised >= 3 * HUGE_PAGE_BYTES  # at most one partial huge page at each end


def test_small_or_non_cpu_tensors_are_left_alone():
    assert advise_huge_pages(torch.zeros(1000)) == 0
    assert advise_huge_pages(torch.empty(HUGE_PAGE_BYTES, dtype=torch.uint8, device="meta")) == 0
    assert huge_page_bytes(torch.empty(8, device="meta")) == 0


@needs_thp
def test_huge_zeros_and_copy_are_backed_by_huge_pages():
    z = huge_zeros((4 * HUGE_PAGE_BYTES,), torch.uint8)
    assert int(z.count_nonzero()) == 0
    assert huge_page_bytes(z) >= 2 * HUGE_PAGE_BYTES
    src = torch.randn(3 * HUGE_PAGE_BYTES // 4, 4)
    copy = huge_copy(src)
    assert torch.equal(copy, src) and copy.data_ptr() != src.data_ptr()
    assert huge_page_bytes(copy) >= HUGE_PAGE_BYTES


def test_paged_batch_on_huge_pages_holds_the_same_requests():
    trace = synthetic_trace("synthetic", 700)
    plain, huge = paged_batch(trace, 0, 2, 64), paged_batch(trace, 0, 2, 64, huge_pages=True)
    for a, b in zip((plain.q, plain.k, plain.v, plain.page_table, plain.seq_lens),
                    (huge.q, huge.k, huge.v, huge.page_table, huge.seq_lens)):
        assert torch.equal(a, b)
