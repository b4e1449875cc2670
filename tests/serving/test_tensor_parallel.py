"""Tensor parallelism on CPU: louver with ``--tp-size 2`` (torch.distributed over gloo), each rank
serving its own KV heads, gives the greedy tokens of ``--tp-size 1`` under the dense policy, and
its certified steps stay certified on every rank.

SGLang 0.5.23 alone does not start CPU ranks (it builds a PyNccl communicator on the CPU
device); louver's plugin builds gloo groups without the CUDA communicators
(``louver_sgl/serving/cpu_parallel.py``). SGLang binds each CPU rank to the cores of one NUMA node unless ``SGLANG_CPU_OMP_THREADS_BIND``
says otherwise (``sglang/srt/utils/numa_utils.py``: it asserts dp x tp x pp <= NUMA nodes); these
machines have one node, so the test gives each rank one core (``0|1``).
"""

from __future__ import annotations

import json
import os
import random

import pytest

from louver_eval.data.tiny_model import make_tiny_llama
from louver_eval.server import free_port, generate, sglang_server

ENV = {"LOUVER_POLICY": "dense", "LOUVER_MIN_SPARSE_TOKENS": "0", "LOUVER_PAGE_SIZE": "32",
       "LOUVER_SINK_PAGES": "0", "LOUVER_RECENT_PAGES": "0"}


@pytest.mark.slow  # two servers, about two minutes
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor parallelism over 2 ranks needs 2 cores")
def test_tp2_dense_matches_tp1_and_certified_stays_certified(tmp_path):
    model = make_tiny_llama(tmp_path / "tiny")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(5)
    prompts = [" ".join(str(rng.randrange(vocab)) for _ in range(n)) for n in (150, 420)]
    outputs = {}
    for tp in (1, 2):
        env = {**ENV, "LOUVER_STATS_FILE": str(tmp_path / f"stats-tp{tp}.json"),
               **({"SGLANG_CPU_OMP_THREADS_BIND": "0|1"} if tp == 2 else {})}
        with sglang_server(model, "louver", free_port(), env, ["--tp-size", str(tp)],
                           log_path=tmp_path / f"tp{tp}.log") as url:
            outputs[tp] = [generate(url, p, max_new_tokens=16)["output_ids"] for p in prompts]
            if tp == 2:
                certified = generate(url, prompts[1], max_new_tokens=8, rid="cert",
                                     custom_params={"louver": {"policy": "certified", "eps": 1e-3}})
    assert outputs[2] == outputs[1], "tp 2 changed the dense greedy tokens"
    assert certified["meta_info"]["completion_tokens"] == 8
    for name in ("stats-tp2.json", "stats-tp2.tp1.json"):  # each rank's own statistics file
        rank = json.loads((tmp_path / name).read_text())
        assert rank["sparse_steps"] > 0, name
        account = rank["requests"]["cert"]
        assert account["policy"]["eps"] == 1e-3 and account["mass_bound_max"] < 1e-3, (name, account)
