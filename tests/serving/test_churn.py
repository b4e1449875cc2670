"""Load and radix churn on the CPU server: every request that was not dropped completes, the
server stays healthy, and probe prompts answer the same after the churn as before it.

Four shared prefixes of mixed lengths over a small KV pool (the radix cache evicts; freed pages
are refilled by other requests), every sixth request streamed and dropped by the client
mid-stream; the full version (slow tier) is 64 requests at concurrency 8 over 6,000 tokens, the
short one (fast tier) 20 requests at concurrency 4 over 3,000 tokens; the sparse path forced (no minimum length, pages of 16, the dense fallback off: every decode step
of every request reads its pages through the index).
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from louver_eval.data.fetch_model import ensure_model
from louver_eval.data.texts import load_text
from louver_eval.churn import ChurnPlan, probe_answers, run_churn
from louver_eval.server import free_port, sglang_server

# (plan, KV pool tokens): both in the slow tier (the short one takes 1.5-3 min on two cores; the
# fast tier's eviction, refill and radix reuse are serving/test_engine.py's)
PLANS = [pytest.param(ChurnPlan(requests=20, concurrency=4), 3000, id="short", marks=pytest.mark.slow),
         pytest.param(ChurnPlan(), 6000, id="full", marks=pytest.mark.slow)]
ENV = {"LOUVER_PROFILE": "none", "LOUVER_PAGE_SIZE": "16", "LOUVER_MIN_SPARSE_TOKENS": "0",
       "LOUVER_POLICY": "certified", "LOUVER_EPS": "1e-3", "LOUVER_DENSE_FALLBACK_FRACTION": "1.0"}




@pytest.mark.parametrize("plan,pool", PLANS)
def test_churn_completes_every_request_and_keeps_probe_answers(plan, pool, tmp_path):
    text = load_text("bible")
    words = load_text("paul_graham").split()
    probes = [" ".join(words[i: i + 350]) + "\n\nSummarize the passage in one sentence:" for i in (0, 5000, 20000)]
    stats = tmp_path / "stats.json"
    extra = ["--dtype", "float32", "--max-total-tokens", str(pool), "--max-running-requests", str(plan.concurrency)]
    with sglang_server(ensure_model(), "louver", free_port(), {**ENV, "LOUVER_STATS_FILE": str(stats)}, extra,
                       log_path=tmp_path / "server.log") as url:
        first = probe_answers(url, probes)
        before = probe_answers(url, probes)
        assert first == before, "the probes themselves do not repeat (numerics, not the index)"
        result = run_churn(url, text, plan)
        assert not result.failed, result.failed[:3]
        assert result.completed + result.dropped == plan.requests and result.dropped == plan.requests // plan.drop_every
        urllib.request.urlopen(url + "/health", timeout=30)
        after = probe_answers(url, probes)
        counters = json.loads(stats.read_text())
    assert after == before, "a probe answered differently after the churn (stale index after a refill?)"
    assert counters["pages_built"] > 0 and counters["pages_reused"] > 0 and counters["sparse_steps"] > 0
    assert counters["dense_fallback_steps"] == 0, "a step fell back to dense with the fallback off"
    assert counters["pages_built"] > pool // 16, "no page was freed and refilled: the pool did not churn"
    print(f"churn: {result.completed} completed, {result.dropped} dropped in {result.seconds:.0f} s; "
          f"index pages built {counters['pages_built']}, reused {counters['pages_reused']}, "
          f"rebuilt on read {counters['pages_rebuilt_on_read']}")
