"""Chunked prefill end to end: a CPU server with ``--chunked-prefill-size 64`` (pages of 16, so
every prompt is prefilled in several chunks of four pages each).

* under the dense policy louver gives ``torch_native``'s greedy tokens, chunked the same way;
* under the certified policy (dense fallback off) every decode step takes the sparse path, each
  prompt's full pages were all built by the extend forwards that filled them (none is left for
  the decode step to rebuild on read), and each request's own account says so.
"""

from __future__ import annotations

import json
import random

from louver_eval.data.tiny_model import make_tiny_llama
from louver_eval.server import SLEEP_ON_IDLE, ServerProcess, free_port, generate, sglang_servers

PAGE, CHUNK, NEW_TOKENS = 16, 64, 8
CHUNKED = ["--chunked-prefill-size", str(CHUNK), "--dtype", "float32"]
LOUVER = {"LOUVER_PROFILE": "none", "LOUVER_PAGE_SIZE": str(PAGE), "LOUVER_MIN_SPARSE_TOKENS": "0",
          "LOUVER_SINK_PAGES": "0", "LOUVER_RECENT_PAGES": "0", "LOUVER_DENSE_FALLBACK_FRACTION": "1.0"}


def test_chunked_prefill_matches_dense_and_builds_every_chunk(tmp_path):
    model = make_tiny_llama(tmp_path / "tiny")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(3)
    prompts = [" ".join(str(rng.randrange(vocab)) for _ in range(n)) for n in (90, 200)]
    stats = tmp_path / "stats.json"
    runs = {"torch_native": ("torch_native", {}),
            "dense": ("louver", {**LOUVER, "LOUVER_POLICY": "dense"}),
            "certified": ("louver", {**LOUVER, "LOUVER_POLICY": "certified", "LOUVER_EPS": "1e-3",
                                     "LOUVER_STATS_FILE": str(stats)})}
    servers = {name: ServerProcess(model, backend, free_port(), env, CHUNKED + SLEEP_ON_IDLE, tmp_path / f"{name}.log")
               for name, (backend, env) in runs.items()}
    outputs = {}
    with sglang_servers(list(servers.values())):  # one server queried at a time, the others asleep
        for name, server in servers.items():
            outputs[name] = [generate(server.url, p, max_new_tokens=NEW_TOKENS) for p in prompts]
            server.stop()  # writes its stats file
    ids = {name: [o["output_ids"] for o in outs] for name, outs in outputs.items()}
    assert ids["dense"] == ids["torch_native"]
    counters = json.loads(stats.read_text())
    assert counters["pages_rebuilt_on_read"] == 0, "a chunk's pages were not built by the forward that filled them"
    for out in outputs["certified"]:
        prompt_tokens = out["meta_info"]["prompt_tokens"]
        assert prompt_tokens > 2 * CHUNK  # several chunks
        mine = counters["requests"][out["meta_info"]["id"]]
        assert mine["pages_built"] == prompt_tokens // PAGE and mine["pages_reused"] == 0, mine
        assert mine["sparse_steps"] > 0 and mine["dense_fallback_steps"] == 0 and mine["dense_short_steps"] == 0
        assert mine["indexed_keys"] > 0, mine
