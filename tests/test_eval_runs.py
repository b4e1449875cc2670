"""Small versions of every evaluation, on the real offline SmolLM2 model and captured traces.

Each runs the same command as the full evaluation with ``--small`` into a temporary cache and
result file, then checks the invariants of its result: recall exactly 1.0 and measured dropped
mass within the reported bound at every query-step, well-formed per-method tables, and for the
needle-in-a-haystack grid (one CPU server, marked slow) a complete, scored cell table.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from louver_eval.data.fetch_model import ensure_model
from louver_eval.data.texts import load_text
from louver_eval.hf_decode import DecodeRunner, load_eval_model, prefill
from louver_eval.kl import dense_logits, policy_logits
from louver_eval.policies import make_policy, text_window_ids

NUM_LAYERS, NUM_HEADS = 30, 9


def _run(tmp_path, module: str, *extra: str) -> dict:
    out = tmp_path / f"{module}.json"
    cmd = [sys.executable, "-m", f"benchmarks.quality.{module}", "--small", "--cache", str(tmp_path / "cache"),
           "--out", str(out), *extra]
    subprocess.run(cmd, check=True, timeout=600)
    result = json.loads(out.read_text())
    assert result["machine"]["date"] and result["command"].endswith("--small")
    return result


def test_exactness_small(tmp_path):
    result = _run(tmp_path, "eval_exactness")
    total = result["total"]
    assert result["complete"] and total["query_steps"] == 2 * 4 * NUM_LAYERS * NUM_HEADS
    assert total["keys_at_or_above_T"] > 0 and total["missed"] == 0 and total["recall"] == 1.0
    assert total["bound_violations"] == 0
    assert sorted(map(int, result["per_layer"])) == list(range(NUM_LAYERS))
    for layer in result["per_layer"].values():
        assert 0.0 < layer["candidate_fraction"] <= 1.0 and 0.0 < layer["page_survival"] <= 1.0
    for policy, mass in result["mass"].items():
        assert mass["measured_le_bound"] == mass["query_steps"], policy
    certified = result["mass"]["certified-1e-3"]
    assert certified["sparse_query_steps"] > 0 and certified["bound"][-1] < 1e-3


def test_tradeoff_small(tmp_path):
    result = _run(tmp_path, "eval_tradeoff")
    methods = result["methods"]
    assert set(methods) == {"budget-0.1", "certified-1e-2", "oracle_topk-0.1", "quest-0.1", "streaming-0.1"}
    for name, row in methods.items():
        assert row["query_heads"] == 2 * 16 * NUM_HEADS, name
        assert 0.0 < row["attended_fraction"] <= 1.0 and 0.0 <= row["dropped_mass"] < 1.0
    for name in ("budget-0.1", "certified-1e-2"):
        assert methods[name]["measured_le_bound"] == methods[name]["query_heads"]
    assert methods["certified-1e-2"]["max_dropped_mass"] < 1e-2
    # the same number of indexed keys per head, chosen by exact score vs by recency
    assert methods["oracle_topk-0.1"]["dropped_mass"] <= methods["streaming-0.1"]["dropped_mass"]
    for cell in result["per_cell"]:
        oracle, window = cell["methods"]["oracle_topk-0.1"], cell["methods"]["streaming-0.1"]
        assert oracle["dropped_mass"]["max"] <= window["dropped_mass"]["max"] + 1e-12


def test_kl_small(tmp_path):
    result = _run(tmp_path, "eval_kl")
    assert set(result["policies"]) == {"certified-1e-2", "budget-0.1", "quest-0.1"}
    for name, row in result["policies"].items():
        assert row["tokens"] == 4 and 0.0 <= row["mean_kl"] <= row["max_kl"], name
        assert 0.0 <= row["top1_agreement"] <= 1.0 and 0.0 < row["attended_fraction"] <= 1.0


def test_dense_policy_kl_is_zero():
    """The decode hook itself changes nothing: louver's dense policy reproduces sdpa's logits."""
    runner = DecodeRunner(make_policy("dense"))
    model, tokenizer = load_eval_model(ensure_model(), runner)
    ids = text_window_ids(tokenizer, load_text("paul_graham"), 330_000, 203)
    cache, _ = prefill(model, ids[:200], runner)
    want = dense_logits(model, cache, ids[200:], runner)
    got = policy_logits(model, cache, ids[200:], runner, len(ids))
    assert runner.layers and len(runner.layers) == NUM_LAYERS  # every layer went through the policy
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
    assert bool((got.argmax(-1) == want.argmax(-1)).all())


@pytest.mark.slow
def test_niah_small(tmp_path):
    result = _run(tmp_path, "eval_niah")
    assert result["missing_configs"] == [] and set(result["cells"]) == {"certified-1e-2"}
    assert result["dtype"] == "float32" and (tmp_path / "cache" / "float32" / "certified-1e-2").is_dir()
    for config, cells in result["cells"].items():
        assert set(cells) == {"single-512-0.5", "multikey-512", "multivalue-512"}, config
        for cell in cells.values():
            assert 0.0 <= cell["score"] <= 1.0 and cell["prompt_tokens"] > 512
    summary = result["summary"]["certified-1e-2"]
    assert summary["prompts"] == 3 and set(summary["kinds"]) == {"single", "multikey", "multivalue"}
