"""The backend's sparse decode equals masked dense attention on the same candidate sets.

A decode batch runs through ``LouverAttnBackend`` inside SGLang's attention kit (real pools,
shuffled page layout, prefix K/V written outside the backend so pages are built on first read).
Every louver step the backend takes is recorded with the key set that step itself attended (the
wrapper asks the backend's own decode call for it) and replayed through the plain-torch reference;
every key scoring at least T must be in the backend's attended set, and its output must be fp64
attention over that set.
"""

from __future__ import annotations

import unittest

import pytest
import torch

from louver_sgl.decode import DecodeResult, api
from louver_sgl.decode.reference import reference_decode
from louver_sgl.serving import backend as backend_module
from louver_sgl.serving.plugin import register

register()

from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods import dense_attention as kit  # noqa: E402


class _Case(unittest.TestCase):
    __test__ = False

    def runTest(self) -> None:  # pragma: no cover
        pass


def _decode_fixture(monkeypatch, env: dict, name: str, prefix_lens: tuple[int, ...]):
    """The backend's options from ``env`` (``LOUVER_*``), and the kit's decode batch of three
    requests over them (4 query heads, 2 KV heads, pages of 16, fp32): built, not yet run."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    case = kit.DenseAttentionCase(name=name, backend="louver", forward_mode=ForwardMode.DECODE,
                                  num_heads=4, num_kv_heads=2, page_size=16, prefix_lens=prefix_lens)
    with torch.no_grad():
        return kit.build_dense_attention_fixture(_Case(), case, device="cpu", dtype=torch.float32,
                                                 max_context_len=512)


@pytest.mark.parametrize("policy,extra", [("budget", {"LOUVER_BUDGET": "0.2"}), ("certified", {"LOUVER_EPS": "1e-2"}),
                                          ("fixed", {"LOUVER_FIXED_THRESHOLD": "0.5"})])
def test_backend_decode_matches_reference(policy, extra, monkeypatch):
    # no dense fallback: the compiled path's candidate superset may cross the fallback fraction
    # where the reference's does not, and this test compares candidate sets; no profile: the plain
    # config (8-bit codes, every request sparse) whatever this machine's nearest profile is
    env = {"LOUVER_POLICY": policy, "LOUVER_SINK_PAGES": "0", "LOUVER_RECENT_PAGES": "0",
           "LOUVER_DENSE_FALLBACK_FRACTION": "1.0", "LOUVER_PROFILE": "none", **extra}
    calls = []

    def recording(self, q, k_cache, v_cache, store, sigma, **kwargs):
        # the backend's own call, with its attended set returned beside what the backend asked for
        result = real(self, q, k_cache, v_cache, store, sigma, **{**kwargs, "attended": True})
        plan = self.current_plan
        calls.append(((q, k_cache, v_cache, plan.page_table, plan.seq_lens, store, sigma, self.config),
                      result.out.clone(), result.stats, result.attended))
        return DecodeResult(result.out, result.stats if kwargs.get("stats") else None)

    real = api.LouverDecode.run
    monkeypatch.setattr(api.LouverDecode, "run", recording)
    fixture = _decode_fixture(monkeypatch, env, "sparse_decode", (100, 250, 37))
    kit.run_dense_fixture_eager(fixture)
    assert calls, "the backend did not run the louver decode step"
    assert any(bool((~m).any()) for *_, attended in calls for m in attended), "no step pruned a key"
    for args, out, stats, attended in calls:
        q, k_cache, v_cache, page_table, seq_lens, store, sigma, config = args
        want, info = reference_decode(q, k_cache, v_cache, page_table, seq_lens, store, sigma, config)
        # certified steps attend every candidate and the compiled int8 bounds may add a few (each
        # below T, inside the certified mass bound); gated policies attend identical sets
        slack = 4 * float(stats.mass_bound.max()) * float(v_cache.abs().max()) if policy == "certified" else 0.0
        torch.testing.assert_close(out.float(), want, atol=2e-5 + slack, rtol=1e-5)
        _assert_own_set(q, k_cache, v_cache, page_table, seq_lens, sigma, out, stats, attended, info,
                        config.page_size)


def _assert_own_set(q, k_cache, v_cache, page_table, seq_lens, sigma, out, stats, attended, info, size):
    """Recall 1.0 on the backend's own attended set (fp64 scores against its T), the reference's
    set inside it, the dropped mass within the bound, and the output fp64 attention over it."""
    groups = q.shape[1] // k_cache.shape[1]
    for b, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n)
        slots = page_table[b, pos // size] * size + pos % size
        scores = torch.einsum("hd,lhd->hl", q[b].double(), k_cache[slots].double().repeat_interleave(groups, 1))
        must = scores >= stats.threshold[b].double()[:, None]
        assert not bool((must & ~attended[b]).any()), "a key scoring >= T was not attended by the backend"
        assert bool((info[b]["attended"] <= attended[b]).all()), "the backend missed a key the reference attends"
        p_all = torch.softmax(sigma * scores, dim=1)
        assert bool(((p_all * ~attended[b]).sum(1) <= stats.mass_bound[b].double() + 1e-9).all())
        p = torch.softmax((sigma * scores).masked_fill(~attended[b], float("-inf")), dim=1)
        values = v_cache[slots].double().repeat_interleave(groups, 1)
        scale = float(values.abs().max())
        torch.testing.assert_close(out[b].double(), torch.einsum("hl,lhd->hd", p, values), atol=2e-5 * scale, rtol=0)


def test_requests_with_their_own_policy_share_the_forward_in_groups(monkeypatch):
    """Three requests of one decode forward, one asking for dense attention, one for certified
    eps = 1e-4, one taking the server's budget 0.2: each group is planned and run on its own rows,
    the dense row equals the kit's dense reference, the server-policy row equals the same forward
    run without per-request policies, and the certified group's bound is under its own eps."""
    from louver_sgl.serving import cpu_path
    from louver_sgl.serving.request_policy import parse

    env = {"LOUVER_POLICY": "budget", "LOUVER_BUDGET": "0.2", "LOUVER_SINK_PAGES": "0", "LOUVER_RECENT_PAGES": "0",
           "LOUVER_PROFILE": "none"}

    def run(policies):
        monkeypatch.setattr(cpu_path, "requests_of", lambda forward_batch, batch_size: policies)
        calls = []
        real = api.LouverDecode.run

        def recording(self, q, *args, **kwargs):
            result = real(self, q, *args, **kwargs)
            calls.append((self.config.threshold, q.shape[0], result.stats))
            return result

        monkeypatch.setattr(api.LouverDecode, "run", recording)
        fixture = _decode_fixture(monkeypatch, env, "request_policies", (300, 250, 280))
        with torch.no_grad():
            out = kit.run_dense_fixture_eager(fixture)
            want = kit.expected_dense_fixture_output(fixture)
        monkeypatch.setattr(api.LouverDecode, "run", real)
        return out.reshape(3, -1), want.reshape(3, -1), calls

    grouped, dense_want, calls = run([parse({"louver": {"policy": "dense"}}), None,
                                      parse({"louver": {"policy": "certified", "eps": 1e-4}})])
    alone, _, _ = run(None)
    kinds = {(policy.kind, rows) for policy, rows, _ in calls}
    assert kinds == {("dense", 1), ("budget", 1), ("certified", 1)}, kinds
    torch.testing.assert_close(grouped[0].float(), dense_want[0].float(), atol=2e-5, rtol=1e-5)
    # the same step on its own rows: equal up to fp32 summation order (the batch's chunking differs)
    torch.testing.assert_close(grouped[1], alone[1], atol=1e-6, rtol=1e-5)
    assert not torch.equal(alone[0], dense_want[0]), "the server's budget policy should differ from dense here"
    certified = [stats for policy, _, stats in calls if policy.certified]
    assert certified and all(float(s.mass_bound.max()) < 1e-4 for s in certified)


def test_the_estimate_share_is_kept_per_request_and_layer(monkeypatch):
    """Under ``estimate_share_max`` the CPU path runs each request at its own share
    (``decode.share_control``, keyed by request id and layer): the first forward at the config's
    share, the next one lowered by √2 for the requests with a lowered head and kept for the others;
    every step certified."""
    import dataclasses

    from louver_sgl.decode.share_control import STEP
    from louver_sgl.serving import cpu_path

    env = {"LOUVER_POLICY": "certified", "LOUVER_EPS": "1e-2", "LOUVER_CERTIFIED_PASSES": "1",
           "LOUVER_CERTIFIED_RULE": "a_posteriori", "LOUVER_ESTIMATE_SHARE": "8", "LOUVER_ESTIMATE_SHARE_MAX": "16",
           "LOUVER_SINK_PAGES": "0", "LOUVER_RECENT_PAGES": "0", "LOUVER_PROFILE": "none"}
    rids = ["r0", "r1", "r2"]
    groups = cpu_path.CpuDecodePath._groups
    monkeypatch.setattr(cpu_path.CpuDecodePath, "_groups",  # the kit's batch carries no request ids
                        lambda self, fb: tuple(dataclasses.replace(g, rids=rids) for g in groups(self, fb)))
    calls, real = [], api.LouverDecode.run

    def recording(self, q, *args, **kwargs):
        result = real(self, q, *args, **kwargs)
        calls.append((kwargs["estimate_share"].clone(), result.stats))
        return result

    monkeypatch.setattr(api.LouverDecode, "run", recording)
    fixture = _decode_fixture(monkeypatch, env, "share_control", (300, 250, 280))
    for _ in range(2):  # the same decode forward twice: the second reads the first's outcomes
        kit.run_dense_fixture_eager(fixture)
    (first, stats), (second, _) = calls
    assert first.tolist() == [8.0] * 3
    lowered = stats.lowered.any(1)
    assert torch.allclose(second, torch.where(lowered, 8.0 / STEP, 8.0).double()), (second, lowered)
    assert all(float(s.mass_bound.max()) < 1e-2 for _, s in calls)
    path = fixture.backend.path
    assert [key for control in path.share_controls.values() for key in control._state] == [(r, 0) for r in rids]
