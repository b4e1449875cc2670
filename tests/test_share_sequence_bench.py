"""The share-sequence benchmark on a small synthetic trace: the control's state carries from step
to step, every step is exact, and the sweep's outcomes are those of per-request runs."""

from __future__ import annotations

import pytest
import torch

from conftest import implementations_here
from louver_eval.data.paged import paged_batch
from louver_sgl import LouverConfig, PageIndexStore
from louver_sgl.decode.plan import plan_decode
from louver_sgl.decode.share_control import STEP

pytestmark = pytest.mark.skipif("cpu" not in implementations_here("cpu"), reason="the compiled CPU step")

LENGTH, STEPS, H_Q, H_KV, D = 2048, 6, 6, 2, 64


def _trace() -> dict:
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(LENGTH, H_KV, D, generator=gen)
    keys[..., :4] += 4 * torch.randn(LENGTH, H_KV, 1, generator=gen)
    queries = torch.randn(STEPS, H_Q, D, generator=gen)
    queries[..., :4] *= 3
    meta = {"length": LENGTH, "softmax_scale": D ** -0.5}
    return {"keys": {0: keys.half()}, "values": {0: torch.randn(LENGTH, H_KV, D, generator=gen).half()},
            "queries": {0: queries}, "query_positions": torch.arange(LENGTH - STEPS, LENGTH), "meta": meta}


@pytest.fixture(scope="module")
def case():
    from benchmarks.cpu.share_sequence import INDEX
    pb = paged_batch(_trace(), 0, STEPS, INDEX["page_size"])
    store = PageIndexStore(LouverConfig(**INDEX), len(pb.k) // INDEX["page_size"], H_KV, D, pb.k.dtype)
    store.build_pages(pb.k, plan_decode(pb.page_table, pb.seq_lens, LouverConfig(**INDEX)).page_ids)
    return pb, store


def test_a_sequence_runs_its_steps_in_order_with_the_controls_state(case, monkeypatch):
    from benchmarks.cpu import share_sequence as bench
    pb, store = case
    monkeypatch.setitem(bench.CONTROLS, "s32-max32", (32.0, 0.0))
    fixed = bench.run_sequence(pb, store, 1e-2, "s32-max32", rounds=1)  # far above what passes here
    adaptive = bench.run_sequence(pb, store, 1e-2, "s8-max32", rounds=1)
    assert fixed["shares"] == [32.0] * STEPS and fixed["lowered_steps"] > 0
    assert adaptive["shares"][0] == 8.0 and len(adaptive["shares"]) == STEPS
    for row in (fixed, adaptive):
        assert row["recall"] == 1.0 and row["bound_max"] < 1e-2 and row["louver_ms"] > 0 and row["dense_ms"] > 0
    # a lowered step lowers the next step's share by √2 (above the floor of 1), a clean one keeps it
    # (fewer than RAISE_AFTER clean steps); the last step's outcome moves no later share
    pairs = list(zip(adaptive["shares"], adaptive["shares"][1:]))
    lowered = sum(n == pytest.approx(max(1.0, s / STEP)) and n < s for s, n in pairs)
    assert not any(n > s for s, n in pairs)
    assert lowered <= adaptive["lowered_steps"] <= lowered + 1 and lowered > 0


def test_the_sweep_records_each_step_at_each_share(case):
    from benchmarks.cpu.share_sequence import LADDER, sweep
    pb, store = case
    out = sweep(pb, store, 1e-2)
    assert out["shares"] == list(LADDER)
    for name in ("lowered", "lowered_groups", "bound_over_eps", "union"):
        assert len(out[name]) == len(LADDER) and all(len(row) == STEPS for row in out[name])
    passed = [[not low for low in row] for row in out["lowered"]]
    assert all(b <= 1.0 for row, ok in zip(out["bound_over_eps"], passed) for b, o in zip(row, ok) if o)
    assert any(out["lowered"][-1]) and not any(out["lowered"][0])  # share 32 fails here, share 1 passes
    assert all((groups > 0) == low and groups <= H_KV for lows, gs in zip(out["lowered"], out["lowered_groups"])
               for low, groups in zip(lows, gs))


# Tolerance of a dense variant's output against fp64 attention, by its dtype: bf16 keeps 8
# mantissa bits, and the bmm variants round the probabilities and V to it before their product
# (0.028 at outputs up to 2.5 on this case, against 0.012 for bf16 SDPA and 0.006 for fp16 bmm).
DENSE_TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}


def _attention64(req, size: int, value_shift: int = 0) -> torch.Tensor:
    """fp64 attention ``[H_q, D]`` of one request over its context (``value_shift``: each key
    paired with the value ``value_shift`` slots away, a wrong gather)."""
    pos = torch.arange(int(req.seq_lens[0]))
    slots = req.page_table[0, pos // size] * size + pos % size
    k, v = req.k[slots].double(), req.v[slots].double().roll(value_shift, 0)  # [L, H_kv, D]
    q = req.q[0].double().view(H_KV, -1, D)
    p = torch.softmax(torch.einsum("hgd,lhd->hgl", q, k) * req.sigma, -1)
    return torch.einsum("hgl,lhd->hgd", p, v).reshape(H_Q, D)


def test_each_step_is_paired_with_dense_attention_over_its_own_request(case):
    """The dense side of a step (every variant ``fastest_dense`` may pick, not only the one that
    wins on this machine) attends request b's own keys in the shared pool: its output equals fp64
    attention over that request's context within its dtype's tolerance, which a gather pairing
    each key with its neighbour's value exceeds many times over."""
    from benchmarks.cpu.decode_cpu import dense_variants
    from benchmarks.cpu.share_sequence import INDEX, dense_step, one_request
    pb, _ = case
    size = INDEX["page_size"]
    names = list(dense_variants(one_request(pb, 0), page_size=size))
    assert len(names) == 12
    for b in (0, STEPS - 1):
        req = one_request(pb, b)
        want = _attention64(req, size)
        wrong = _attention64(req, size, value_shift=1)
        assert float((wrong - want).abs().max()) > 4 * max(DENSE_TOLERANCE.values())
        for name in names:
            tol = DENSE_TOLERANCE[name.rsplit("-", 1)[1]]
            got = torch.stack([x.reshape(-1, D) for x in dense_step(req, name)()]).reshape(H_Q, D)
            torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol, msg=name)
