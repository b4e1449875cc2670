"""Bookkeeping of the backend's CUDA decode path (page table, completed-page builds, buffers).

Runs the Triton kernels under ``TRITON_INTERPRET=1`` without CUDA, natively with it.
"""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# the path imports SGLang's KV pool types; the lent GPU machine has no SGLang
pytest.importorskip("sglang.srt.mem_cache.memory_pool", reason="needs SGLang (absent on the lent GPU machine)")

from conftest import slow_where_interpreted  # noqa: E402
from louver_kernels.triton.launch import TritonLaunch  # noqa: E402
from louver_sgl import LouverConfig, PageIndexStore  # noqa: E402
from louver_sgl.decode import HeadShapes, louver_decode  # noqa: E402
from louver_sgl.index import grid  # noqa: E402
from louver_sgl.serving.cuda_path import CudaDecodePath  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
P = 16


def _pool(lens, max_context=256, h_kv=2, dim=64, seed=0):
    """A KV pool, a req_to_token map with shuffled pages (rows 1.. used) and the request rows."""
    gen = torch.Generator().manual_seed(seed)
    pages = sum(math.ceil(max_context / P) for _ in lens) + 1
    k = torch.randn(pages * P, h_kv, dim, generator=gen).half()
    v = torch.randn(pages * P, h_kv, dim, generator=gen).half()
    perm = torch.randperm(pages - 1, generator=gen) + 1  # page 0 stays a dummy
    req_to_token = torch.zeros(len(lens) + 1, max_context, dtype=torch.int32)
    per = math.ceil(max_context / P)
    for r in range(len(lens)):
        row_pages = perm[r * per:(r + 1) * per]
        req_to_token[r + 1] = (row_pages[:, None] * P + torch.arange(P)).reshape(-1)[:max_context].int()
    return k.to(DEVICE), v.to(DEVICE), req_to_token.to(DEVICE), torch.arange(1, len(lens) + 1, device=DEVICE)


def test_prepare_decode_and_address_stability():
    config = LouverConfig(page_size=P, policy="budget", budget=0.2, sample_size=32)
    lens = torch.tensor([200, 33, 129], dtype=torch.int32, device=DEVICE)
    k, v, req_to_token, rows = _pool(lens.tolist())
    store = PageIndexStore(config, k.shape[0] // P, 2, 64, torch.float16, device=DEVICE, code_layout="token")
    store.build_pages(k.cpu(), torch.arange(store.num_pages)) if DEVICE == "cpu" else \
        store.build_pages(k, torch.arange(store.num_pages, device=DEVICE))
    path = CudaDecodePath(config, TritonLaunch(pages_per_split=4), 256, HeadShapes(6, 2, 64, 64), DEVICE)
    path.init_graph_state(8)
    workspace = path.graph.impl.workspace
    addresses = (workspace.page_table.data_ptr(), workspace.o.data_ptr())
    bs = path.plan_batch(req_to_token, rows, lens, in_graph=True)
    assert bs == 3 and (workspace.page_table.data_ptr(), workspace.o.data_ptr()) == addresses
    want_table = (req_to_token[rows.long(), ::P] // P)
    assert torch.equal(workspace.page_table[:3, : want_table.shape[1]].long(), want_table.long())
    q = torch.randn(3, 6, 64, generator=torch.Generator().manual_seed(2)).half().to(DEVICE)
    out = torch.empty_like(q)
    path.decode(q, k, v, store, 0.125, out)
    direct, _ = louver_decode(q, k, v, want_table.int(), lens, store, 0.125, config, impl="triton",
                              launch=TritonLaunch(pages_per_split=4))
    torch.testing.assert_close(out, direct, atol=0, rtol=0)
    eager = torch.empty_like(q)  # a batch outside the graphs plans into its own workspace
    path.plan_batch(req_to_token, rows, lens, in_graph=False)
    path.decode(q, k, v, store, 0.125, eager)
    assert workspace.o.data_ptr() == addresses[1] and path.eager.impl.workspace is not workspace
    torch.testing.assert_close(eager, direct, atol=0, rtol=0)


def test_build_completed_builds_only_finished_pages():
    config = LouverConfig(page_size=P)
    lens = torch.tensor([32, 33, 48], dtype=torch.int32, device=DEVICE)  # requests 0 and 2 finish a page
    k, v, req_to_token, rows = _pool(lens.tolist())
    store = PageIndexStore(config, k.shape[0] // P, 2, 64, torch.float16, device=DEVICE, code_layout="token")
    path = CudaDecodePath(config, TritonLaunch(), 256, HeadShapes(6, 2, 64, 64), DEVICE)
    path.init_graph_state(4)
    last = req_to_token[rows.long(), (lens - 1).long()]
    path.build_completed(store, k, last, lens)
    built = (store.tensors["scale"] != 0).flatten(1).any(1).cpu()
    want = torch.zeros_like(built)
    want[(last.long() // P)[torch.tensor([0, 2])].cpu()] = True
    assert torch.equal(built, want)
    page = int(last[0]) // P
    ref = grid.build_grid(k.cpu().view(-1, P, 2, 64)[[page]], 8, torch.float16)
    assert torch.equal(store.tensors["lo"][page].cpu(), ref["lo"][0])
    assert torch.equal(store.tensors["codes"].view(-1, P, 2, 64)[page].cpu(), ref["codes"][0])


@slow_where_interpreted  # 30 s under the interpreter; the conformance suite runs each Triton step
def test_auto_dispatch_chooses_per_batch_size_with_each_implementations_launch():
    """``cuda_decode=auto``: the launch section's rules choose per batch size (a graph captured
    for a batch size keeps its choice); each implementation runs with its own launch fields and
    gives the step its own kernels compute."""
    config = LouverConfig(page_size=P, policy="budget", budget=0.2, sample_size=32)
    section = {"pages_per_split": 4, "triton_tiled": {"tile_pages": 2},
               "cuda_dispatch": [{"impl": "triton_tiled", "min_rows": 6}]}
    path = CudaDecodePath(config, section, 256, HeadShapes(6, 2, 64, 64), DEVICE, impl="auto")
    assert [path.implementation(bs) for bs in (1, 2, 3, 8)] == ["triton", "triton", "triton_tiled", "triton_tiled"]
    path.init_graph_state(4)
    assert set(path.graphs) == {"triton", "triton_tiled"}
    assert path.graphs["triton_tiled"].impl.launch.tile_pages == 2
    assert path.graphs["triton"].impl.launch.pages_per_split == 4
    lens = torch.tensor([200, 33, 129], dtype=torch.int32, device=DEVICE)
    k, v, req_to_token, rows = _pool(lens.tolist())
    store = PageIndexStore(config, k.shape[0] // P, 2, 64, torch.float16, device=DEVICE, code_layout="token")
    store.build_pages(k.cpu(), torch.arange(store.num_pages)) if DEVICE == "cpu" else \
        store.build_pages(k, torch.arange(store.num_pages, device=DEVICE))
    q = torch.randn(3, 6, 64, generator=torch.Generator().manual_seed(2)).half().to(DEVICE)
    for in_graph in (True, False):
        path.plan_batch(req_to_token, rows, lens, in_graph=in_graph)
        assert path.active.impl_name == "triton_tiled"
        out = torch.empty_like(q)
        path.decode(q, k, v, store, 0.125, out)
        table = (req_to_token[rows.long(), ::P] // P).int()
        direct, _ = louver_decode(q, k, v, table, lens, store, 0.125, config, impl="triton_tiled",
                                  launch=TritonLaunch(pages_per_split=4, tile_pages=2))
        torch.testing.assert_close(out, direct, atol=0, rtol=0)
    path.plan_batch(req_to_token, rows[:2], lens[:2], in_graph=True)
    assert path.active.impl_name == "triton"
