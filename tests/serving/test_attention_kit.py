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
