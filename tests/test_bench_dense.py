"""The decode benchmark's dense variants all compute the same attention (its baseline is honest)."""

import torch

from benchmarks.cpu.decode_cpu import dense_variants
from louver_eval.data.paged import paged_batch
from louver_sgl.decode.impl_torch import dense_attention
from test_tune_study import synthetic_trace


def test_dense_variants_agree_with_dense_attention():
    pb = paged_batch(synthetic_trace("synthetic", 300), 0, 2, 64)
    variants = dense_variants(pb)
    assert {"bmm-gqa-float32", "sdpa-gqa-bfloat16"} <= set(variants)
    size = 64
    for b, n in enumerate(pb.seq_lens.tolist()):
        pos = torch.arange(n)
        slots = pb.page_table[b, pos // size] * size + pos % size
        want = dense_attention(pb.q[b], pb.k[slots], pb.v[slots], pb.sigma)  # [H_q, D]
        for name, fn in variants.items():
            got = fn()[b].reshape(want.shape).float()
            tol = 2e-2 if "float32" not in name else 1e-4
            torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=name)


def test_paired_timing_alternates_and_times_both():
    """timeit_paired calls the two functions in alternation (AB, BA, ...) and returns both medians
    and the median of the rounds' own ratios."""
    from benchmarks.cpu.decode_cpu import timeit_paired

    calls = []
    base_ms, fn_ms, ratio = timeit_paired(lambda: calls.append("a"), lambda: calls.append("b"), repeats=4)
    assert calls == ["a", "b"] + ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert base_ms >= 0 and fn_ms >= 0 and ratio >= 0


def test_paired_ratio_is_the_median_of_the_rounds_ratios(monkeypatch):
    """Drift between rounds moves the medians' ratio, not the rounds' own: base at 2, 4, 8, 3 ms
    against fn's 1, 2, 4, 3 gives a paired ratio of 2 where the medians' ratio is 3.5 / 2.5."""
    import benchmarks.cpu.decode_cpu as bench

    monkeypatch.setattr(bench, "alternating_times", lambda fns, rounds, before=None, **kw: {
        "base": [2.0, 4.0, 8.0, 3.0], "fn": [1.0, 2.0, 4.0, 3.0]})
    base_ms, fn_ms, ratio = bench.timeit_paired(lambda: None, lambda: None, repeats=4)
    assert (base_ms, fn_ms, ratio) == (3.5, 2.5, 2.0)


def test_alternating_times_shuffled_with_warmup_rounds():
    """Shuffled rounds call every function once per round, time only the rounds after the warm-up
    ones, and run ``before`` ahead of every call, warm-up included."""
    from benchmarks.cpu.decode_cpu import alternating_times

    calls, befores = [], []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = alternating_times(fns, 5, before=lambda: befores.append(len(calls)), shuffle=True, warmup_rounds=2)
    assert {name: len(t) for name, t in times.items()} == {"a": 5, "b": 5, "c": 5}
    assert len(calls) == 21 and len(befores) == 21
    assert all(sorted(calls[3 * r: 3 * r + 3]) == ["a", "b", "c"] for r in range(7))
    assert len({tuple(calls[3 * r: 3 * r + 3]) for r in range(7)}) > 1  # the order changes between rounds
