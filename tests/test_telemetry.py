"""Serving telemetry: which path every request-step took, fractions over sparse steps only,
recorded steps summed lazily, and the statistics file a client reads per request."""

from __future__ import annotations

import json

import torch

from louver_sgl.decode.contract import StepStats
from louver_sgl.serving import telemetry
from louver_sgl.serving.telemetry import Counts, Telemetry, log_line


def _stats(seed: int, num_indexed=(640, 320)) -> StepStats:
    gen = torch.Generator().manual_seed(seed)
    packed = torch.rand(2, 5, 5, generator=gen, dtype=torch.float64).mul(100).floor()
    packed[:, 4, 0] = torch.tensor([float(seed % 2), 0.0])  # dense fallback flags
    packed[..., 4] = (packed[..., 0] > 80).double()  # lowered heads (the request row's column is unused)
    num_indexed = torch.tensor(num_indexed)
    return StepStats.from_packed(packed, num_indexed, num_indexed // 64)


def test_window_counts_paths_and_sums_sparse_steps_only(monkeypatch):
    monkeypatch.setattr(telemetry, "PENDING_LIMIT", 3)
    tel = Telemetry(interval=0)
    steps = [_stats(seed) for seed in range(7)]
    for stats in steps:
        tel.record_step(stats)
        assert len(tel.pending) < 3
    window = tel.snapshot()["window"]
    sparse = [(s, r) for s in steps for r in range(2) if not bool(s.dense_fallback[r])]
    assert (window["sparse_steps"], window["dense_fallback_steps"], window["dense_short_steps"]) == (11, 3, 0)
    attended = sum(float(s.candidates[r].sum()) for s, r in sparse)
    indexed = sum(float(s.num_indexed[r]) * 4 for s, r in sparse)
    assert window["attended_fraction"] == attended / indexed
    skipped = sum(float(s.pages_skipped[r].sum()) for s, r in sparse)
    assert window["pages_skipped_fraction"] == skipped / sum(float(s.num_pages[r]) * 4 for s, r in sparse)
    assert window["mass_bound_max"] == max(float(s.mass_bound[r].max()) for s, r in sparse)
    lowered = sum(bool(s.lowered[r].any()) for s, r in sparse)
    assert 0 < window["lowered_steps"] == lowered < len(sparse)
    assert window["lowered_step_fraction"] == lowered / len(sparse)
    assert not tel.pending


def test_device_counts_sum_what_the_host_counts_sum():
    """The CUDA path's device-side sums (graph-capturable ops) equal ``Counts.add``, short and
    fallback rows included, and a drain zeroes them."""
    host, device = Counts(), telemetry.DeviceCounts("cpu")
    steps = [_stats(seed) for seed in range(5)] + [_stats(7, num_indexed=(0, 320))]
    for stats in steps:
        host.add(stats)
        device.add(stats)
    device.add_pages_built(torch.tensor(3))
    drained, built = device.drain()
    assert drained.sparse_steps == host.sparse_steps > 0 and drained.dense_short_steps == host.dense_short_steps == 1
    assert drained.dense_fallback_steps == host.dense_fallback_steps > 0 and built == 3
    for name in ("indexed_keys", "attended_keys", "indexed_pages", "pages_skipped", "mass_bound_max",
                 "lowered_steps"):
        assert getattr(drained, name) == getattr(host, name), name
    assert host.lowered_steps > 0
    assert device.drain() == (Counts(), 0)


def test_a_window_without_sparse_steps_says_so():
    """Short requests only (no indexed page): no fraction of 0 that would read as perfect sparsity."""
    counts = Counts()
    counts.add(_stats(0, num_indexed=(0, 0)))
    summary = counts.summary()
    assert counts.dense_short_steps == 2 and counts.sparse_steps == 0
    assert summary["attended_fraction"] is None and summary["mass_bound_max"] is None
    line = log_line(counts, 4, 2, 0)
    assert "no sparse step in this window" in line and "keys attended" not in line
    assert "2 dense (short)" in line and "built 4, reused 2" in line


def test_statistics_file_holds_process_totals_across_windows(tmp_path):
    path = tmp_path / "stats.json"
    tel = Telemetry(interval=1, stats_file=str(path))
    for seed in (0, 2):  # two windows, each flushed after its forward
        tel.record_step(_stats(seed))
        tel.end_decode_forward()
    data = json.loads(path.read_text())
    assert data["decode_forwards"] == 2 and data["sparse_steps"] == 4
    assert data["attended_keys"] == sum(float(_stats(s).candidates.sum()) for s in (0, 2))


def test_pending_steps_of_different_batches_sum_as_one_by_one():
    """The pending steps are summed concatenated; batches of different sizes, short requests and
    fallbacks give the same counts as adding each step on its own."""
    steps = [_stats(1), _stats(2, num_indexed=(0, 128)), _stats(3, num_indexed=(64, 0))]
    gen = torch.Generator().manual_seed(9)
    packed = torch.rand(3, 5, 5, generator=gen, dtype=torch.float64).mul(100).floor()
    packed[:, 4, 0] = torch.tensor([0.0, 1.0, 0.0])
    steps.append(StepStats.from_packed(packed, torch.tensor([256, 512, 0]), torch.tensor([4, 8, 0])))
    one_by_one = Counts()
    for stats in steps:
        one_by_one.add(stats)
    tel = Telemetry(interval=0)
    for stats in steps:
        tel.record_step(stats)
    tel._sum_pending()
    assert tel.window == one_by_one


def test_recording_a_step_leaves_it_packed_and_a_mix_sums_alike():
    """record_step reads a packed step's batch size without unpacking it; pending steps of which
    some were unpacked sum as the packed ones do."""
    steps = [_stats(seed) for seed in range(4)]
    tel = Telemetry(interval=0)
    for stats in steps:
        tel.record_step(stats, ["a", "b"], 3)
    assert all(s.packed is not None for s in tel.pending) and tel.pending_layers == [3] * 8
    packed_sum = telemetry.pending_rows(tel.pending)
    mixed = [_stats(seed) for seed in range(4)]
    mixed[2].candidates  # unpacked
    mixed_sum = telemetry.pending_rows(mixed)
    for field in telemetry.SUMMED:
        torch.testing.assert_close(getattr(packed_sum, field), getattr(mixed_sum, field), atol=0, rtol=0)


def test_statistics_file_keeps_one_account_per_request(tmp_path, monkeypatch):
    """Rows of batches with different request ids sum into each request's own account (the
    same as summing that request's rows alone); prefill pages count per request; the oldest
    accounts leave beyond REQUEST_LIMIT."""
    monkeypatch.setattr(telemetry, "REQUEST_LIMIT", 3)
    path = tmp_path / "stats.json"
    tel = Telemetry(interval=0, stats_file=str(path), page_size=64)
    tel.count_prefill("a", built=10, prefix=0)
    tel.count_prefill("b", built=2, prefix=8)
    steps = [_stats(seed) for seed in range(4)]
    for stats in steps[:2]:
        tel.record_step(stats, ["a", "b"])
    tel.record_step(steps[2], ["b", "a"])
    tel.record_step(steps[3], None)  # no ids: counted in the totals only
    tel.end_decode_forward()
    data = json.loads(path.read_text())
    for rid, rows in (("a", [(0, 0), (1, 0), (2, 1)]), ("b", [(0, 1), (1, 1), (2, 0)])):
        alone = Counts()
        for seed, row in rows:
            s = steps[seed]
            alone.add(StepStats(**{f: getattr(s, f)[row:row + 1] for f in s.__dataclass_fields__}))
        got = data["requests"][rid]
        assert got["sparse_steps"] == alone.sparse_steps and got["dense_fallback_steps"] == alone.dense_fallback_steps
        assert got["attended_keys"] == alone.attended_keys and got["mass_bound_max"] == alone.mass_bound_max
    assert (data["requests"]["a"]["pages_built"], data["requests"]["b"]["pages_reused"]) == (10, 8)
    assert data["pages_built"] == 12 and data["sparse_steps"] == sum(
        1 for s in steps for r in range(2) if not bool(s.dense_fallback[r]))
    for rid in ("c", "d"):
        tel.count_prefill(rid, built=1, prefix=0)
    tel.dump()
    assert list(json.loads(path.read_text())["requests"]) == ["b", "c", "d"]
    # SGLang's /health generations (a router checks every few seconds) get no account
    from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX

    for i in range(5):
        tel.count_prefill(f"{HEALTH_CHECK_RID_PREFIX}_{i}", built=0, prefix=0)
        tel.record_step(steps[0], [f"{HEALTH_CHECK_RID_PREFIX}_{i}", "d"])
    tel.end_decode_forward()
    data = json.loads(path.read_text())
    assert list(data["requests"]) == ["b", "c", "d"] and data["sparse_steps"] > 0


def test_chunked_prefill_counts_its_own_chunks_as_built_not_reused(tmp_path):
    """A 4-chunk prompt (64 pages a chunk) over a 10-page cached prefix: reuse is the cached
    prefix once, not every chunk's prefix; a new request under the same id after the first
    decode step counts its own prefix again."""
    tel = Telemetry(interval=0, stats_file=str(tmp_path / "stats.json"))
    prefix = 10
    for chunk in range(4):
        tel.count_prefill("long", built=64 - (prefix if chunk == 0 else 0), prefix=prefix)
        prefix = 64 * (chunk + 1)
    acc = tel.requests["long"]
    assert (acc.pages_built, acc.pages_reused) == (256 - 10, 10)
    assert (tel.pages_built, tel.pages_reused) == (246, 10)
    tel.count_prefill("other", built=2, prefix=250)  # another request over the cached document
    assert tel.requests["other"].pages_reused == 250
    tel.count_prefill(None, built=1, prefix=5)  # no request id: every prefix page is reuse
    assert tel.pages_reused == 265
    tel.record_step(_stats(0), ["long", "other"])  # decoding: their prefills are over
    assert not tel.prefill_counted
    tel.count_prefill("long", built=3, prefix=250)
    assert tel.requests["long"].pages_reused == 260


def test_statistics_file_counts_lowered_steps_per_layer(tmp_path, monkeypatch):
    """With a statistics file, each layer's sparse request-steps with a lowered head are counted
    under that layer (summed over flushes of the pending rows; rows given no layer under -1), and
    the per-layer counts add up to the totals' lowered steps."""
    monkeypatch.setattr(telemetry, "PENDING_LIMIT", 4)
    path = tmp_path / "stats.json"
    tel = Telemetry(interval=0, stats_file=str(path))
    steps = [(_stats(seed), seed % 3) for seed in range(9)] + [(_stats(9), None)]
    for stats, layer in steps:
        tel.record_step(stats, ["a", "b"], layer)
    tel.end_decode_forward()
    data = json.loads(path.read_text())
    expected: dict[str, int] = {}
    for stats, layer in steps:
        for r in range(2):
            if bool(stats.lowered[r].any()) and not bool(stats.dense_fallback[r]) and int(stats.num_indexed[r]):
                key = str(-1 if layer is None else layer)
                expected[key] = expected.get(key, 0) + 1
    assert expected and data["lowered_steps_by_layer"] == expected
    assert sum(expected.values()) == data["lowered_steps"]
    quiet = Telemetry(interval=0)  # without a file: no per-layer count (its host reads are skipped)
    for stats, layer in steps:
        quiet.record_step(stats, ["a", "b"], layer)
    assert quiet.snapshot()["totals"]["lowered_steps"] == data["lowered_steps"] and quiet.lowered_by_layer == {}
