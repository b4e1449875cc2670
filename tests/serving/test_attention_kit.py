"""SGLang's attention test kit with louver: the dense policy reproduces dense attention."""

from __future__ import annotations

import unittest

import pytest
import torch

from louver_sgl.serving.plugin import register

register()

from sglang.test.kits.attention_unittest.attention_methods import dense_attention as kit  # noqa: E402

# louver's index pages are KV pages of at least 2 tokens: the kit's page-size-1 case does not apply.
CASES = [case for case in kit.make_dense_cases("louver") if case.page_size >= 2]


class _Case(unittest.TestCase):
    __test__ = False  # a carrier for the kit's skipTest, not a test

    def runTest(self) -> None:  # pragma: no cover - only a carrier for skipTest
        pass


@pytest.mark.parametrize("dense_pages", ["1", "0"], ids=["sink+recent", "all-indexed"])
@pytest.mark.parametrize("policy", ["dense", "certified"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_kit_case(case, policy, dense_pages, monkeypatch):
    """Every kit case louver supports, against the kit's independent reference.

    With ``dense`` the output equals dense attention; with ``certified`` at the kit's tolerance
    (3e-2) the bound eps = 1e-3 keeps the output within it as well. ``all-indexed`` turns the
    always-dense sink and recent pages off so that every full page goes through the index (the
    kit writes prefix K/V directly, so those pages are built when first read).
    """
    monkeypatch.setenv("LOUVER_POLICY", policy)
    monkeypatch.setenv("LOUVER_SINK_PAGES", dense_pages)
    monkeypatch.setenv("LOUVER_RECENT_PAGES", dense_pages)
    with torch.no_grad():
        kit.run_dense_attention_case(_Case(), case, device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("extend_backend", ["torch_native", "torch_native_prefix"])
@pytest.mark.parametrize("prefix_lens,extend_lens", [((0,), (70,)), ((40, 0, 130), (33, 5, 1))])
def test_extend_backends_match_the_reference(extend_backend, prefix_lens, extend_lens, monkeypatch):
    """Both CPU extend backends louver composes reproduce the kit's reference, with and without a
    cached prefix (torch_native_prefix attends for the extended rows only)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from louver_sgl.serving import backend as backend_module

    used = []
    real_init = backend_module.LouverAttnBackend.__init__

    def init(self, model_runner):
        real_init(self, model_runner)
        used.append(self.extend_name)

    monkeypatch.setattr(backend_module.LouverAttnBackend, "__init__", init)
    monkeypatch.setenv("LOUVER_EXTEND_BACKEND", extend_backend)
    case = kit.DenseAttentionCase(name="extend", backend="louver", forward_mode=ForwardMode.EXTEND, num_heads=6,
                                  num_kv_heads=2, page_size=16, prefix_lens=prefix_lens, extend_lens=extend_lens)
    with torch.no_grad():
        kit.run_dense_attention_case(_Case(), case, device="cpu", dtype=torch.float32, max_context_len=256)
    assert used == [extend_backend]


def test_extend_runs_in_the_named_sglang_backend(monkeypatch):
    """Prefill goes to the backend ``LOUVER_EXTEND_BACKEND`` names (here a recording subclass of
    torch_native registered under its own name), which writes K/V; louver builds the pages it
    completed, and the output is the kit's dense reference."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from louver_sgl.serving import backend as backend_module

    calls = []

    class Recording(TorchNativeAttnBackend):
        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            calls.append(layer.layer_id)
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    monkeypatch.setitem(ATTENTION_BACKENDS, "louver_test_recording", Recording)
    monkeypatch.setenv("LOUVER_EXTEND_BACKEND", "louver_test_recording")
    built = []
    real_build = backend_module.ServingIndex.build

    def build(self, layer_id, page_ids):
        built.append(int(page_ids.numel()))
        return real_build(self, layer_id, page_ids)

    monkeypatch.setattr(backend_module.ServingIndex, "build", build)
    case = kit.DenseAttentionCase(name="extend", backend="louver", forward_mode=ForwardMode.EXTEND, num_heads=4,
                                  num_kv_heads=2, page_size=16, prefix_lens=(0, 40), extend_lens=(70, 33))
    with torch.no_grad():
        kit.run_dense_attention_case(_Case(), case, device="cpu", dtype=torch.float32, max_context_len=128)
    assert calls, "the named extend backend did not run"
    assert sum(built) >= 4 + 2  # pages completed by the extend: 70 // 16 and (40 + 33) // 16 - 40 // 16


def test_an_unknown_extend_backend_is_refused(monkeypatch):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    monkeypatch.setenv("LOUVER_EXTEND_BACKEND", "no_such_backend")
    case = kit.DenseAttentionCase(name="extend", backend="louver", forward_mode=ForwardMode.EXTEND, num_heads=4,
                                  num_kv_heads=2, page_size=16, prefix_lens=(0,), extend_lens=(20,))
    with pytest.raises(ValueError, match="LOUVER_EXTEND_BACKEND='no_such_backend' is not a registered"):
        kit.run_dense_attention_case(_Case(), case, device="cpu", dtype=torch.float32)
