"""The compiled CPU steps around the attend kernel against their torch specifications."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import make_paged
from louver_sgl import LouverConfig
from louver_sgl.decode.fused import compiled_exact_part, merge_reference
from louver_sgl.decode.plan import plan_decode
from louver_sgl.decode.step import exact_part

ops_module = pytest.importorskip("louver_kernels.cpu_ops")
if not ops_module.cpu_ops_available():
    pytest.skip("compiled CPU kernels unavailable", allow_module_level=True)
OPS = ops_module.load_cpu_ops()
LENS = [300, 700, 20, 64, 129, 1]


def _batch(dtype, groups=3, h_kv=2, dim=64, sample_size=40):
    cfg = LouverConfig(page_size=16, sample_size=sample_size)
    k, v, table, lens = make_paged(LENS, 16, h_kv, dim, seed=7, dtype=dtype)
    q = torch.randn(len(LENS), h_kv * groups, dim, generator=torch.Generator().manual_seed(8)) * 2
    return q, k, v, plan_decode(table, lens, cfg), cfg


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_exact_part_matches_torch(dtype):
    q, k, _, plan, cfg = _batch(dtype)
    sigma = 1 / math.sqrt(64)
    want = exact_part(q, k, plan, sigma)
    got = compiled_exact_part(q, k, plan, sigma, cfg.sample_size, OPS)
    torch.testing.assert_close(got.s_dense, want.s_dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.ref, want.ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.z_dense, want.z_dense, atol=1e-9, rtol=1e-5)
    torch.testing.assert_close(got.z_lb, want.z_lb, atol=1e-9, rtol=1e-5)
    width = want.sample[0].shape[1]
    torch.testing.assert_close(got.sample[0][:, :width], want.sample[0], atol=1e-5, rtol=1e-5)
    assert bool(torch.isneginf(got.sample[0][:, width:]).all())
    assert torch.equal(got.sample[1], want.sample[1])


def test_exact_part_rejects_a_narrow_sample_buffer():
    q, k, _, plan, _ = _batch(torch.float32, sample_size=40)
    with pytest.raises(RuntimeError, match="sample buffer"):
        compiled_exact_part(q, k, plan, 0.125, 8, OPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merge_matches_torch(dtype):
    q, k, v, plan, _ = _batch(dtype, groups=2, h_kv=3, dim=64)
    sigma = 0.125
    ex = exact_part(q, k, plan, sigma)
    batch, heads = q.shape[:2]
    gen = torch.Generator().manual_seed(9)
    chunk_req = torch.tensor([0, 0, 1, 1, 1, 3, 4, 4])  # requests 2 and 5 have no chunk
    n = len(chunk_req)
    m = torch.randn(n, heads, generator=gen) * 3
    m[1, :2] = -math.inf  # empty chunk states
    l = torch.rand(n, heads, generator=gen) * 5 + 0.1
    l[1, :2] = 0.0
    o = torch.randn(n, heads, 64, generator=gen)
    o[1, :2] = 0.0
    want = merge_reference(ex, m.view(n, 3, 2), l.view(n, 3, 2), o.view(n, 3, 2, 64), chunk_req, v, plan, sigma, batch)
    got = torch.empty(batch, heads, 64)
    OPS.merge_chunks(ex.s_dense, plan.dense_slots, plan.dense_req, v, m, l, o, chunk_req, sigma, got)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
