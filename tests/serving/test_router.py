"""louver workers behind sglang-router (``louver_eval.router``), on the tiny random Llama.

Fast tier: two tiny workers behind ``cache_aware``; requests over two shared prefixes all come
back with the answer a worker gives directly, and the prefixes' index pages are reused from the
radix cache. Slow tier: a worker killed under load and restarted (``router_faults``): no request
hangs, errors are statuses with a message, answers equal the reference, the restarted worker
serves again with its index rebuilt from scratch.
"""

from __future__ import annotations

import concurrent.futures
import json
import random

import pytest

from louver_eval.data.tiny_model import make_tiny_llama
from louver_eval.router import louver_workers, sglang_router, split_cores, start_all
from louver_eval.router_faults import FaultPlan, fault_run, summary
from louver_eval.server import free_port, generate

# every request through the index (the tiny prompts are far below any profile's min_sparse_tokens)
TINY_ENV = {"LOUVER_MIN_SPARSE_TOKENS": "0", "LOUVER_PAGE_SIZE": "32", "LOUVER_SINK_PAGES": "0",
            "LOUVER_RECENT_PAGES": "0"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    rng = random.Random(3)
    words = lambda n: " ".join(str(rng.randrange(vocab)) for _ in range(n))  # noqa: E731
    prefixes = [words(400) for _ in range(4)]
    prompts = [f"{p} {words(12)}" for p in prefixes for _ in range(3)]
    return path, prompts  # two groups for the fast test; the fault run's last phase adds the others


def test_split_cores():
    assert split_cores(2, 2) == ["0", "1"] and split_cores(2, 8) == ["0-3", "4-7"]
    assert split_cores(1, 2) == ["0-1"] and split_cores(3, 2) == ["0", "1", "0"]


def test_cache_aware_router_over_two_tiny_workers(tiny, tmp_path):
    model, prompts = tiny
    prompts = prompts[:6]
    workers = louver_workers(model, 2, tmp_path, TINY_ENV, max_total_tokens=20000)
    try:
        start_all(workers)
        direct = [generate(workers[0].url, p, max_new_tokens=8)["text"] for p in prompts]
        workers[0].stop()  # a fresh worker: the direct answers filled its radix cache
        workers[0].start()
        with sglang_router([w.url for w in workers], "cache_aware", free_port(), tmp_path / "router.log") as url:
            first = [generate(url, prompts[i], max_new_tokens=8)["text"] for i in (0, 3)]  # one per prefix
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                rest = list(pool.map(lambda p: generate(url, p, max_new_tokens=8)["text"], prompts))
    finally:
        for worker in workers:
            worker.stop()
    assert first == [direct[0], direct[3]] and rest == direct
    stats = [json.loads((tmp_path / f"stats-{i}.json").read_text()) for i in range(2)]
    assert sum(s["pages_reused"] for s in stats) > 0, "no prefix index page came from a radix cache"
    assert sum(len(s["requests"]) for s in stats) >= len(prompts) + 2


@pytest.mark.slow  # a minute and a half of load, a kill and a restart
def test_a_killed_worker_loses_no_request_silently_and_rejoins(tiny, tmp_path):
    model, prompts = tiny
    plan = FaultPlan(clients=2, before=20.0, during=15.0, after=25.0, max_new_tokens=8, timeout=120.0)
    # round robin: the restarted worker surely gets requests (cache_aware sends a prefix where it
    # went while that worker was down, and breaks load ties towards the first worker)
    run = fault_run(model, prompts[:6], tmp_path, plan, worker_env=TINY_ENV, max_total_tokens=20000,
                    fresh=prompts[6:], policy="round_robin")
    phases = summary(run)
    outcomes = run["outcomes"]
    assert all(o["seconds"] < plan.timeout for o in outcomes), "a request hung"
    assert all(o["status"] == 200 or (o["error"] or "").strip() for o in outcomes), "an error without a message"
    assert any(o["streamed"] for o in outcomes) and any(not o["streamed"] for o in outcomes)
    assert all(o["correct"] is not False for o in outcomes), "a wrong answer"
    assert phases["before"]["answered"] > 0 and phases["after"]["answered"] > 0
    assert run["healthy_workers_at_end"] == 2 and run["killed_while_decoding"]
    restarted = run["worker1_after_restart"]
    assert restarted["requests"] > 0, "the restarted worker served nothing"
    assert restarted["index_pages_built"] > 0  # its index built from scratch
