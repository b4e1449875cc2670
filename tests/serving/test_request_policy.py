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
from louver_eval.server import SLEEP_ON_IDLE, ServerProcess, free_port, generate, post_json, sglang_servers
from louver_sgl import LouverConfig
from louver_sgl.serving import request_policy
from louver_sgl.serving.request_policy import RequestPolicy, describe, parse, requests_of, with_requests


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


@pytest.mark.parametrize("entry, served, message", [
    ({"eps": 10 ** 400}, None, r"custom_params\.louver\.eps must be a finite number, got 1000.*\(401 characters\)"),
    ({"budget": -10 ** 400}, None, r"custom_params\.louver\.budget must be a finite number"),
    ({"policy": "budget", "eps": 1e-3}, None, r"eps applies to the certified policy, not to this request's policy "
                                              r"'budget'"),
    ({"policy": "fixed", "budget": 0.1}, None, r"budget applies to the budget policy"),
    ({"policy": "certified", "fixed_threshold": 1.0}, None, r"fixed_threshold applies to the fixed policy"),
    ({"policy": "dense", "value_gate": False}, None, r"value_gate applies to the budget and fixed policies"),
    ({"eps": 1e-3}, "budget", r"eps applies to the certified policy, not to the server's policy 'budget'"),
])
def test_parse_refuses_numbers_it_cannot_hold_and_parameters_of_another_policy(entry, served, message):
    """A 400-digit integer is a clear error, not an ``OverflowError`` past the 400 path; a parameter
    the request's policy would ignore (its own ``policy`` field, else the server's) is refused."""
    with pytest.raises(ValueError, match=message):
        parse({"louver": entry}, served)
    assert parse({"louver": {"eps": 1e-3}}, "certified") is not None
    assert parse({"louver": {"policy": "budget", "budget": 0.2}}, "certified") is not None


def test_only_parsed_entries_travel_and_the_scheduler_side_never_raises(caplog):
    """The front door leaves the parsed form in the request; the scheduler-side hook reads it
    without parsing: a raw malformed entry there (it skipped the front door) is logged and served
    with the server's policy, and the other requests of the batch keep theirs."""
    policy = parse({"louver": {"policy": "certified", "eps": 1e-4}})
    entry = policy.as_entry()
    assert RequestPolicy.carried(entry) == policy and parse({"louver": entry}) == policy
    assert RequestPolicy.carried({"eps": 2}) is None and RequestPolicy.carried("dense") is None

    class Req:
        def __init__(self, rid, louver):
            self.rid = rid
            self.sampling_params = type("S", (), {"custom_params": {"louver": louver}})()

    batch = type("Batch", (), {"reqs": [Req("good-a", entry), Req("bad", {"eps": 10 ** 400}),
                                        Req("good-b", parse({"louver": {"policy": "dense"}}).as_entry())]})()
    assert with_requests(lambda cls, b: "built", None, batch) == "built"
    assert "request bad carries a louver entry the front door did not parse" in caplog.text
    forward = type("Forward", (), {"rids": ["good-a", "bad", "good-b"]})()
    chosen = requests_of(forward, 3)
    assert chosen[0] == policy and chosen[1] is None and chosen[2].apply(LouverConfig()).threshold.dense
    # ids that do not match the batch's rows: nobody's policy lands on another request's row
    assert requests_of(forward, 4) is None and "carries 3 request ids" in caplog.text
    for rid in ("good-a", "good-b"):
        request_policy._CHOSEN.pop(rid, None)


def test_the_front_door_replaces_the_entry_by_its_parsed_form(monkeypatch):
    monkeypatch.setattr(request_policy, "_served", "cpu")
    monkeypatch.setattr(request_policy, "_served_policy", "budget")
    params = type("SamplingParams", (), {"custom_params": {"louver": {"budget": 0.3}, "other": 1}})()
    request_policy.verified(lambda self: None, params)
    assert params.custom_params == {"louver": {"parsed": True, "budget": 0.3}, "other": 1}
    bad = type("SamplingParams", (), {"custom_params": {"louver": {"eps": 1e-3}}})()
    with pytest.raises(ValueError, match="not to the server's policy 'budget'"):
        request_policy.verified(lambda self: None, bad)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    rng = random.Random(7)
    return path, [" ".join(str(rng.randrange(vocab)) for _ in range(n)) for n in (420, 380)]


def test_requests_choose_their_policy_in_one_batch(tiny, tmp_path):
    model, (dense_prompt, certified_prompt) = tiny
    stats = tmp_path / "stats.json"
    # the certified requests run the one-pass rule a posteriori with the estimate share adapted per
    # request and layer (decode.share_control): random-token prompts, flat attention, lower it
    env = {"LOUVER_POLICY": "certified", "LOUVER_EPS": "1e-2", "LOUVER_MIN_SPARSE_TOKENS": "0",
           "LOUVER_PAGE_SIZE": "32", "LOUVER_SINK_PAGES": "0", "LOUVER_RECENT_PAGES": "0",
           "LOUVER_CERTIFIED_PASSES": "1", "LOUVER_CERTIFIED_RULE": "a_posteriori", "LOUVER_ESTIMATE_SHARE": "8",
           "LOUVER_ESTIMATE_SHARE_MAX": "16", "LOUVER_STATS_FILE": str(stats)}
    dense_server = ServerProcess(model, "torch_native", free_port(), {}, SLEEP_ON_IDLE, tmp_path / "torch_native.log")
    louver = ServerProcess(model, "louver", free_port(), env, SLEEP_ON_IDLE, tmp_path / "louver.log")
    with sglang_servers([dense_server, louver]) as (dense_url, url):  # started together
        want = generate(dense_url, dense_prompt, max_new_tokens=24)["output_ids"]
        dense_server.stop()
        asks = [(dense_prompt, "dense-1", {"policy": "dense"}), (certified_prompt, "cert-1", {"eps": 1e-4})]
        with concurrent.futures.ThreadPoolExecutor(2 + len(_malformed(certified_prompt))) as pool:
            # the malformed requests are sent beside the good ones: each gets its 400, they their answers
            refused = [(pool.submit(post_json, url, where, body), says)
                       for body, where, says in _malformed(certified_prompt)]
            dense, certified = pool.map(lambda a: generate(url, a[0], max_new_tokens=24, rid=a[1],
                                                           custom_params={"louver": a[2]}), asks)
            for future, says in refused:
                status, answer = future.result()
                assert status == 400, (status, answer)
                assert says in json.dumps(answer), answer
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
    assert accounts["cert-1"]["lowered_steps"] <= accounts["cert-1"]["sparse_steps"]
    assert data["lowered_steps"] >= accounts["cert-1"]["lowered_steps"] + accounts["plain-1"]["lowered_steps"]
    assert accounts["plain-1"]["policy"] == {"policy": "certified", "source": "server", "eps": 1e-2}
    assert accounts["openai-1"]["policy"] == {"policy": "budget", "source": "request", "budget": 0.25}
    assert certified["meta_info"]["completion_tokens"] == 24


def _malformed(prompt: str) -> list[tuple[dict, str, str]]:
    """(body, endpoint, what the 400 answer says) of requests the server must refuse."""
    sampling = {"max_new_tokens": 2, "temperature": 0}
    own = lambda louver: {"text": prompt, "sampling_params": {**sampling, "custom_params": {"louver": louver}}}  # noqa: E731
    return [(own({"eps": 2}), "/generate", "custom_params.louver.eps must lie in (0, 1)"),
            (own({"grid_bits": 4}), "/generate", "custom_params.louver: unknown field"),
            ({"model": "tiny", "prompt": prompt, "max_tokens": 2, "custom_params": {"louver": {"policy": "exact"}}},
             "/v1/completions", "custom_params.louver.policy must be one of"),
            (own({"policy": "budget", "eps": 1e-3}), "/generate", "custom_params.louver.eps applies to the certified"),
            # SGLang's JSON parser refuses the number itself (Python callers reach parse: its unit test)
            (own({"eps": 10 ** 400}), "/generate", "number is infinity")]
