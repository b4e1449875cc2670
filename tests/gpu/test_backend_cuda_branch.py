"""The backend's CUDA branch (graph-safe Triton decode path) inside SGLang's attention kit, on CPU
tensors under the Triton interpreter: decode equals the torch reference on the same index."""

from __future__ import annotations

import unittest

import pytest
import torch

pytest.importorskip("sglang.srt.layers.attention.base_attn_backend", reason="needs SGLang (absent on the lent GPU machine)")

from louver_sgl.decode.reference import reference_decode  # noqa: E402
from louver_sgl.serving import backend as backend_module  # noqa: E402
from louver_sgl.serving.plugin import register  # noqa: E402
from louver_sgl.serving.telemetry import Counts  # noqa: E402

register()

from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods import dense_attention as kit  # noqa: E402


class _Case(unittest.TestCase):
    __test__ = False

    def runTest(self) -> None:  # pragma: no cover
        pass


@pytest.mark.parametrize("policy", ["budget", "certified"])
def test_cuda_branch_decode_matches_the_reference(policy, monkeypatch):
    from louver_sgl.serving.cuda_path import CudaDecodePath

    monkeypatch.setenv("LOUVER_POLICY", policy)
    monkeypatch.setenv("LOUVER_FAMILY", "grid")
    monkeypatch.setenv("LOUVER_DENSE_FALLBACK_FRACTION", "1.0")
    # the built-in defaults, not a profile: the generic profile's min_sparse_tokens is above the
    # kit's contexts and would make every step dense
    monkeypatch.setenv("LOUVER_PROFILE", "none")
    monkeypatch.setattr(backend_module.LouverAttnBackend, "_on_cuda", lambda self: True)
    runs, counted = [], Counts()
    real = CudaDecodePath.decode

    def recording(self, q, k_buffer, v_buffer, store, sigma, out, stats=False):
        result = real(self, q, k_buffer, v_buffer, store, sigma, out, stats)
        plan = self.active.current_plan
        runs.append((q.clone(), k_buffer, v_buffer, plan.page_table[: q.shape[0]].clone(),
                     plan.seq_lens[: q.shape[0]].clone(), store, sigma, result.out.clone()))
        counted.add(result.stats)
        return result

    monkeypatch.setattr(CudaDecodePath, "decode", recording)
    case = kit.DenseAttentionCase(name="cuda_branch", backend="louver", forward_mode=ForwardMode.DECODE,
                                  num_heads=4, num_kv_heads=2, page_size=16, prefix_lens=(100, 250, 37))
    with torch.no_grad():
        fixture = kit.build_dense_attention_fixture(_Case(), case, device="cpu", dtype=torch.float16,
                                                    max_context_len=512, head_dim=64, hidden_size=256)
        backend = fixture.backend
        assert isinstance(backend.path, CudaDecodePath)
        pool = backend.token_to_kv_pool
        first = backend._first_layer()
        for layer in range(first, first + int(pool.layer_num)):
            # the kit writes the prefix K/V outside the backend: build their pages as extend would
            backend.index.build(layer, torch.arange(pool.get_key_buffer(layer).shape[0] // 16))
        kit.run_dense_fixture_eager(fixture)
    assert runs, "the CUDA branch did not run"
    # the path's device-side counts, read through the telemetry, are the host sums of its steps
    totals = backend.telemetry.snapshot()["totals"]
    assert totals["sparse_steps"] == counted.sparse_steps > 0
    for name in ("dense_short_steps", "dense_fallback_steps"):
        assert totals[name] == getattr(counted, name)
    for name in ("indexed_keys", "attended_keys", "indexed_pages", "pages_skipped", "mass_bound_max"):
        assert totals[name] == pytest.approx(getattr(counted, name), rel=1e-12)
    for q, k, v, table, lens, store, sigma, out in runs:
        if policy == "budget":  # the same T (sample quantile) and, after the value gate, the same keys
            want, _ = reference_decode(q, k, v, table.long(), lens.long(), store, sigma)
            torch.testing.assert_close(out.float(), want, atol=4e-3, rtol=4e-3)
        else:  # the Triton step certifies with its own (int8) bounds: within its bound of dense
            dense = store.config.with_(policy="dense")
            want, _ = reference_decode(q, k, v, table.long(), lens.long(), store, sigma, dense)
            limit = 2 * store.config.eps * float(v.float().abs().max()) + 4e-3
            assert float((out.float() - want).abs().max()) <= limit
