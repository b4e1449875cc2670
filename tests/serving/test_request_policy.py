"""Accuracy chosen per request (``custom_params["louver"]``): parsing, and through a CPU server.

In one louver server (default certified ε = 1e-2) and one decode batch, a request asking for the
dense policy gets the dense server's greedy tokens while a certified ε = 1e-4 request beside it
reports its own ε in its account; malformed entries get HTTP 400 on ``/generate`` and the
OpenAI endpoint, naming the field and its range, and the next request is served.
"""

from __future__ import annotations

import concurrent.futures
import json
import random

import pytest

from louver_eval.data.tiny_model import make_tiny_llama
from louver_eval.server import free_port, generate, post_json, sglang_server
from louver_sgl import LouverConfig
from louver_sgl.serving.request_policy import RequestPolicy, describe, parse


def test_parse_accepts_the_accuracy_knobs_and_names_what_is_wrong():
    assert parse(None) is None and parse({"thinking_budget": 4}) is None
    policy = parse({"louver": {"policy": "certified", "eps": 1e-4}})
    assert policy == RequestPolicy((("eps", 1e-4), ("policy", "certified")))
    config = policy.apply(LouverConfig(page_size=128, policy="budget"))
    assert config.page_size == 128 and config.threshold.certified and config.eps == 1e-4
    assert describe(config, own=True) == {"policy": "certified", "source": "request", "eps": 1e-4}
    assert parse({"louver": {"policy": "dense"}}).apply(LouverConfig()).threshold.dense
    bad = [({"eps": 2}, r"custom_params\.louver\.eps must lie in \(0, 1\), got 2"),
           ({"policy": "exact"}, r"custom_params\.louver\.policy must be one of"),
           ({"budget": 0}, r"custom_params\.louver\.budget must lie in \(0, 1\]"),
           ({"eps": "1e-3"}, r"custom_params\.louver\.eps must be a int or float"),
           ({"value_gate": 1}, r"custom_params\.louver\.value_gate must be a bool"),
           ({"page_size": 64}, r"unknown field\(s\) \['page_size'\]"),
           ("dense", r"custom_params\.louver must be an object")]
    for entry, message in bad:
        with pytest.raises(ValueError, match=message):
            parse({"louver": entry})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    rng = random.Random(7)
    return path, [" ".join(str(rng.randrange(vocab)) for _ in range(n)) for n in (420, 380)]


def test_requests_choose_their_policy_in_one_batch(tiny, tmp_path):
    model, (dense_prompt, certified_prompt) = tiny
    with sglang_server(model, "torch_native", free_port(), {}, log_path=tmp_path / "torch_native.log") as url:
        want = generate(url, dense_prompt, max_new_tokens=24)["output_ids"]
    stats = tmp_path / "stats.json"
    env = {"LOUVER_POLICY": "certified", "LOUVER_EPS": "1e-2", "LOUVER_MIN_SPARSE_TOKENS": "0",
           "LOUVER_PAGE_SIZE": "32", "LOUVER_SINK_PAGES": "0", "LOUVER_RECENT_PAGES": "0",
           "LOUVER_STATS_FILE": str(stats)}
    with sglang_server(model, "louver", free_port(), env, log_path=tmp_path / "louver.log") as url:
        asks = [(dense_prompt, "dense-1", {"policy": "dense"}), (certified_prompt, "cert-1", {"eps": 1e-4})]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            dense, certified = pool.map(lambda a: generate(url, a[0], max_new_tokens=24, rid=a[1],
                                                           custom_params={"louver": a[2]}), asks)
        for body, where in _malformed(certified_prompt):
            status, answer = post_json(url, where, body)
            assert status == 400, (where, status, answer)
            assert "custom_params.louver" in json.dumps(answer), answer
        after = generate(url, certified_prompt, max_new_tokens=4, rid="plain-1")
        status, completion = post_json(url, "/v1/completions", {
            "model": "tiny", "prompt": certified_prompt, "max_tokens": 4, "temperature": 0, "rid": "openai-1",
            "custom_params": {"louver": {"policy": "budget", "budget": 0.25}}})
    assert dense["output_ids"] == want, "the dense request must decode as the dense server does"
    assert after["meta_info"]["completion_tokens"] == 4 and status == 200, completion
    data = json.loads(stats.read_text())
    accounts = data["requests"]
    assert data["mixed_policy_forwards"] > 0, "the two requests never shared a decode forward"
    assert accounts["dense-1"]["policy"] == {"policy": "dense", "source": "request"}
    assert accounts["cert-1"]["policy"] == {"policy": "certified", "source": "request", "eps": 1e-4}
    assert accounts["cert-1"]["sparse_steps"] > 0 and accounts["cert-1"]["mass_bound_max"] < 1e-4
    assert accounts["plain-1"]["policy"] == {"policy": "certified", "source": "server", "eps": 1e-2}
    assert accounts["openai-1"]["policy"] == {"policy": "budget", "source": "request", "budget": 0.25}
    assert certified["meta_info"]["completion_tokens"] == 24


def _malformed(prompt: str) -> list[tuple[dict, str]]:
    sampling = {"max_new_tokens": 2, "temperature": 0}
    return [({"text": prompt, "sampling_params": {**sampling, "custom_params": {"louver": {"eps": 2}}}}, "/generate"),
            ({"text": prompt, "sampling_params": {**sampling, "custom_params": {"louver": {"grid_bits": 4}}}},
             "/generate"),
            ({"model": "tiny", "prompt": prompt, "max_tokens": 2, "custom_params": {"louver": {"policy": "exact"}}},
             "/v1/completions")]
