"""End to end through ``sglang.Engine`` on CPU with a tiny random Llama (2 layers, GQA 4/2).

One louver engine serves, in order: prompts spanning page boundaries, a pair sharing a long
prefix (radix hit), then enough distinct prompts to evict and refill pages of a small KV pool.
The same sequence through ``torch_native`` gives the reference tokens; a louver engine with
``SGLANG_RADIX_FORCE_MISS=1`` gives the cold-run reference of the prefix-sharing request.
"""

from __future__ import annotations

import json
import os
import random

import pytest

from louver_eval.data.tiny_model import make_tiny_llama

PAGE = 16
NEW_TOKENS = 12


def _prompts(vocab: int) -> dict[str, list[list[int]]]:
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    prefix = tokens(200)
    return {
        "lengths": [tokens(n) for n in (15, 16, 17, 63, 130)],
        "shared": [prefix + tokens(21), prefix + tokens(37)],
        "evict": [tokens(150) for _ in range(6)],
    }


def _serve(model: str, backend: str, prompts: dict, env: dict[str, str]) -> dict[str, list]:
    """Serve the prompt groups in order, one request at a time; with ``LOUVER_STATS_FILE`` set,
    the index counters after each request are in ``out["stats"][group]``."""
    import sglang as sgl

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        engine = sgl.Engine(model_path=model, device="cpu", attention_backend=backend, page_size=PAGE,
                            max_total_tokens=640, disable_overlap_schedule=True, log_level="warning")
        try:
            params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
            out, stats = {}, {}
            stats_file = env.get("LOUVER_STATS_FILE")
            for group, ids in prompts.items():
                # one request at a time: the second shared-prefix request must see the first cached
                out[group], stats[group] = [], []
                for p in ids:
                    out[group].append(engine.generate(input_ids=p, sampling_params=params))
                    if stats_file:
                        stats[group].append(json.loads(open(stats_file).read()))
            out["stats"] = stats
            return out
        finally:
            engine.shutdown()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = _prompts(vocab)
    stats = tmp_path_factory.mktemp("stats") / "louver.json"
    common = {"LOUVER_PAGE_SIZE": str(PAGE), "LOUVER_SINK_PAGES": "0", "LOUVER_RECENT_PAGES": "0"}
    results = {
        "torch_native": _serve(str(model_dir), "torch_native", prompts, {}),
        "dense": _serve(str(model_dir), "louver", prompts, {**common, "LOUVER_POLICY": "dense"}),
        "certified": _serve(str(model_dir), "louver", prompts,
                            {**common, "LOUVER_POLICY": "certified", "LOUVER_STATS_FILE": str(stats)}),
        "cold": _serve(str(model_dir), "louver", {"shared": prompts["shared"][1:]},
                       {**common, "LOUVER_POLICY": "certified", "SGLANG_RADIX_FORCE_MISS": "1"}),
    }
    results["stats"] = json.loads(stats.read_text())
    results["prompts"] = prompts
    return results


def _ids(outputs) -> list[list[int]]:
    return [o["output_ids"] for o in outputs]


def test_dense_policy_matches_torch_native(runs):
    """louver with T = −inf gives the same greedy tokens as torch_native, for every request."""
    for group in ("lengths", "shared", "evict"):
        assert _ids(runs["dense"][group]) == _ids(runs["torch_native"][group]), group


def test_certified_matches_dense_through_eviction(runs):
    """eps = 1e-3 keeps greedy tokens; requests after eviction read rebuilt pages, not stale ones."""
    for group in ("lengths", "shared", "evict"):
        assert _ids(runs["certified"][group]) == _ids(runs["dense"][group]), group
    # more pages were built than the pool holds: slots were freed and refilled in between
    assert runs["stats"]["pages_built"] > 640 // PAGE


def test_radix_hit_reuses_index_and_matches_cold_run(runs):
    """The second shared-prefix request hits the radix cache, reads the first request's index
    pages (counted as reused, not rebuilt) and decodes exactly like a forced-miss cold run."""
    warm = runs["certified"]["shared"][1]
    cached = warm["meta_info"]["cached_tokens"]
    assert cached >= 192
    before, after = runs["certified"]["stats"]["shared"]
    prompt_len = len(runs["prompts"]["shared"][1])
    # only pages past the cached prefix are built (prefill pages, then pages filled while decoding)
    new_pages = (prompt_len + NEW_TOKENS - 1) // PAGE - cached // PAGE
    assert after["pages_built"] - before["pages_built"] == new_pages
    assert after["pages_reused"] - before["pages_reused"] == cached // PAGE
    # the request's own account, by its request id: its prefill's pages, and its decode steps
    mine = after["requests"][warm["meta_info"]["id"]]
    assert (mine["pages_reused"], mine["pages_built"]) == (cached // PAGE, prompt_len // PAGE - cached // PAGE)
    assert mine["sparse_steps"] + mine["dense_short_steps"] + mine["dense_fallback_steps"] > 0
    assert _ids([warm]) == _ids(runs["cold"]["shared"])
    assert runs["cold"]["shared"][0]["meta_info"]["cached_tokens"] == 0
