"""The streaming GPU kernels (``triton_stream``: filter with compacted survivors, attention over
them) against the fused ``triton`` kernels, the torch specification and an fp64 brute force.

Under ``TRITON_INTERPRET=1`` without CUDA (tiny fp16/fp32 inputs), natively with CUDA.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conftest import SLOW_WHERE_INTERPRETED, fp64_request, make_paged  # noqa: E402
from louver_kernels.triton import stream_decode as stream  # noqa: E402
from louver_kernels.triton.launch import TritonLaunch  # noqa: E402
from louver_sgl import LouverConfig, PageIndexStore  # noqa: E402
from louver_sgl.decode import LouverDecode  # noqa: E402
from louver_sgl.decode.reference import reference_decode  # noqa: E402

pytestmark = SLOW_WHERE_INTERPRETED  # the full tier where there is no CUDA (conftest)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENS = [300, 700, 20, 64, 129]
P = 16
# two pages per segment: many segments, so the splits' share of the lists crosses segment ends
LAUNCH = TritonLaunch(pages_per_split=2, survivor_block=16)


def _setup(policy, dtype, groups=3, seed=0, **cfg):
    options = dict(page_size=P, policy=policy, eps=0.05, fixed_threshold=4.0, budget=0.1, sample_size=32,
                   dense_fallback_fraction=1.0)
    config = LouverConfig(**{**options, **cfg})
    k, v, table, lens = make_paged(LENS, P, 2, 64, seed=seed, dtype=dtype)
    store = PageIndexStore(config, len(k) // P, 2, 64, dtype, device=DEVICE, code_layout="token")
    store.build_pages(k.to(DEVICE), torch.arange(store.num_pages, device=DEVICE))
    gen = torch.Generator().manual_seed(seed + 1)
    q = (torch.randn(len(LENS), 2 * groups, 64, generator=gen) * 2).to(dtype)
    return config, q, k, v, table, lens, store


def _run(impl, config, q, k, v, table, lens, store, sigma, launch=LAUNCH):
    decode = LouverDecode(config, DEVICE, impl=impl, launch=launch).plan(table.to(DEVICE), lens.to(DEVICE))
    step_result = decode.run(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), store, sigma, attended=True)
    out, stats, masks = step_result.out, step_result.stats, step_result.attended
    return out.cpu(), stats, [m.cpu() for m in masks], decode


@pytest.mark.parametrize("policy,dtype", [("certified", torch.float16), ("budget", torch.float32),
                                          ("fixed", torch.float16), ("dense", torch.float32)])
def test_stream_attends_the_fused_set_exactly(policy, dtype):
    """Same T, same attended set, same counters as the fused kernels (both gate with the same
    bounds); the output is fp64 attention over that set; recall 1.0 against fp64 scores."""
    config, q, k, v, table, lens, store = _setup(policy, dtype)
    sigma = 3 / math.sqrt(64)
    out, stats, masks, _ = _run("triton_stream", config, q, k, v, table, lens, store, sigma)
    f_out, f_stats, f_masks, _ = _run("triton", config, q, k, v, table, lens, store, sigma)
    assert torch.equal(stats.threshold.cpu(), f_stats.threshold.cpu())
    for name in ("candidates", "pages_skipped", "union_candidates", "values_read", "pages_read", "dense_fallback"):
        assert torch.equal(getattr(stats, name).cpu(), getattr(f_stats, name).cpu()), name
    torch.testing.assert_close(stats.mass_bound.cpu(), f_stats.mass_bound.cpu(), rtol=1e-4, atol=1e-12)
    tol = 4e-3 if dtype != torch.float32 else 2e-5
    for b in range(len(LENS)):
        assert torch.equal(masks[b], f_masks[b]), f"request {b}: attended sets differ"
        s, vv = fp64_request(q, k, v, table, lens, b, P)
        assert not bool(((s >= stats.threshold[b].cpu().double()[:, None]) & ~masks[b]).any()), "false negatives"
        p = torch.softmax(sigma * s.masked_fill(~masks[b], -math.inf), dim=1)
        torch.testing.assert_close(out[b].double(), torch.einsum("hl,lhd->hd", p, vv),
                                   atol=tol * vv.abs().max().item(), rtol=0)


def test_lists_hold_every_survivor_once_with_its_heads():
    """Each (request, KV head) list is the dense rows plus the union of the heads' candidates,
    each slot once, its head mask the heads whose bound reaches T (fp64 reference: the value
    gate off, so attended = candidates)."""
    config, q, k, v, table, lens, store = _setup("fixed", torch.float32, value_gate=False)
    sigma = 1 / math.sqrt(64)
    _, stats, masks, decode = _run("triton_stream", config, q, k, v, table, lens, store, sigma)
    lists = decode.impl.lists.view(len(LENS))
    cap = lists.slot.shape[3]
    for b, n in enumerate(lens.tolist()):
        for h in range(2):
            counts = lists.count[b, h].cpu().clamp(max=cap)
            got = {}
            for s, c in enumerate(counts.tolist()):
                for slot, heads in zip(lists.slot[b, h, s, :c].tolist(), lists.heads[b, h, s, :c].tolist()):
                    assert slot not in got, "a slot listed twice"
                    got[slot] = heads & ((1 << 30) - 1)
            pos = torch.arange(n)
            slots = (table[b, pos // P] * P + pos % P).tolist()
            want = {}
            for i, slot in enumerate(slots):
                bits = sum(1 << g for g in range(3) if bool(masks[b][3 * h + g, i]))
                if bits:
                    want[slot] = bits
            assert got == want, f"request {b}, KV head {h}"


def test_overflowing_lists_fall_back_to_dense_attention():
    """A capacity the long requests' survivors pass: those requests are attended densely (every
    key, bound 0) by the fallback pass; requests within capacity are unchanged."""
    config, q, k, v, table, lens, store = _setup("fixed", torch.float32, fixed_threshold=-1e30)
    sigma = 1 / math.sqrt(64)
    tight = LAUNCH.with_(survivor_percent=60)  # segments of 32 tokens hold 20: every full one overflows
    out, stats, masks, decode = _run("triton_stream", config, q, k, v, table, lens, store, sigma, launch=tight)
    lists = decode.impl.lists.view(len(LENS))
    overflow = lists.overflow.cpu()
    assert bool(overflow.any()) and torch.equal(stats.dense_fallback.cpu(), overflow)
    for b in range(len(LENS)):
        s, vv = fp64_request(q, k, v, table, lens, b, P)
        assert bool(masks[b].all())
        want = torch.einsum("hl,lhd->hd", torch.softmax(sigma * s, dim=1), vv)
        torch.testing.assert_close(out[b].double(), want, atol=2e-5 * vv.abs().max().item(), rtol=0)
        if overflow[b]:
            assert float(stats.mass_bound[b].abs().max()) == 0.0


def test_gated_set_equals_the_torch_reference():
    """With the value gate the attended set depends on exact scores only: it equals the torch
    reference's (as for the fused kernels)."""
    config, q, k, v, table, lens, store = _setup("budget", torch.float16)
    sigma = 1 / math.sqrt(64)
    cpu_store = PageIndexStore(config, store.num_pages, 2, 64, torch.float16)
    cpu_store.build_pages(k, torch.arange(store.num_pages))
    _, info = reference_decode(q, k, v, table, lens, cpu_store, sigma)
    _, _, masks, _ = _run("triton_stream", config, q, k, v, table, lens, store, sigma)
    for b, n in enumerate(lens.tolist()):
        assert torch.equal(masks[b], info[b]["attended"])


def test_segment_capacity_and_group_limit():
    assert stream.segment_capacity(TritonLaunch(pages_per_split=16, survivor_percent=25), 64) == 256
    assert stream.segment_capacity(TritonLaunch(pages_per_split=1, survivor_percent=1), 16) == 16
    with pytest.raises(ValueError, match="at most 100"):
        TritonLaunch(survivor_percent=101)
    config, q, k, v, table, lens, store = _setup("budget", torch.float32, groups=31)
    with pytest.raises(ValueError, match="at most 30 query heads per KV head"):
        _run("triton_stream", config, q, k, v, table, lens, store, 0.125)


def test_one_pass_certified_on_the_device():
    """``certified_passes=1``: T is the provisional level where the check passes (the certificate
    below eps); a request whose check fails (a NaN in a dense key) gets the histogram rule's T
    and certificate, on the device, and every other request keeps its one-pass T and output."""
    config, q, k, v, table, lens, store = _setup("certified", torch.float32, certified_passes=1, eps=0.01)
    sigma = 1 / math.sqrt(64)
    clean_out, clean, masks, _ = _run("triton_stream", config, q, k, v, table, lens, store, sigma)
    assert bool((clean.mass_bound.cpu() < config.eps).all())
    for b in range(len(LENS)):
        s, vv = fp64_request(q, k, v, table, lens, b, P)
        assert not bool(((s >= clean.threshold[b].cpu().double()[:, None]) & ~masks[b]).any()), "false negatives"
        dropped = (torch.softmax(sigma * s, dim=1) * ~masks[b]).sum(1)
        assert bool((dropped <= clean.mass_bound[b].cpu() + 1e-12).all())
    bad = k.clone()
    tail = int(lens[0]) - 1  # request 0's last token: in its dense tail
    bad[int(table[0, tail // P]) * P + tail % P, 1, 5] = float("nan")
    out, stats, _, _ = _run("triton_stream", config, q, bad, v, table, lens, store, sigma)
    _, two, _, _ = _run("triton_stream", config.with_(certified_passes=2), q, bad, v, table, lens, store, sigma)
    torch.testing.assert_close(stats.threshold[0].cpu(), two.threshold[0].cpu(), atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(stats.mass_bound[0].cpu(), two.mass_bound[0].cpu(), atol=0, rtol=0, equal_nan=True)
    assert torch.equal(stats.threshold[1:].cpu(), clean.threshold[1:].cpu())
    assert torch.equal(out[1:], clean_out[1:])
