"""The README's main command, ``bash scripts/run.sh``, as a user runs it, with a short demo and
``DEMO_EXIT=1`` (stop after the demo): the server starts on the shipped fp32 CPU profile, the
demo client's long request takes louver's sparse path, the second request over the same
document reads the first one's index pages from the radix cache, and the idle scheduler sleeps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from louver_eval.server import free_port

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_FP32 = ROOT / "louver_sgl" / "profiles" / "cpu_amd_epyc_avx2.float32.json"


def test_main_command_demo_takes_the_sparse_path(tmp_path):
    report, log = tmp_path / "demo.json", tmp_path / "run.log"
    env = {**os.environ, "DEMO_TOKENS": "2600", "DEMO_MAX_NEW_TOKENS": "6", "DEMO_EXIT": "1",
           "DEMO_REPORT": str(report), "PORT": str(free_port()), "LOUVER_STATS_FILE": str(tmp_path / "stats.json"),
           # the shipped fp32 profile on whatever CPU runs this (it is chosen by itself on AVX2 ones)
           "LOUVER_PROFILE": str(SHIPPED_FP32)}
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", "scripts/run.sh", "--skip-server-warmup"], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=1500)
        finally:  # the server and its workers, whatever happened
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    text = log.read_text()
    assert rc == 0, text[-4000:]
    assert f"louver: using profile {SHIPPED_FP32}" in text, "the shipped fp32 profile was not the one applied"
    assert "louver demo done (DEMO_EXIT=1)" in text and "decode request-steps" in text
    assert "louver: --sleep-on-idle on" in text, "the CPU server should not spin while idle"
    demo = json.loads(report.read_text())
    first, second = demo["requests"]
    assert first["prompt_tokens"] > 2048  # above the profile's min_sparse_tokens: the sparse path applies
    mine = first["account"]
    assert mine["sparse_steps"] > 0 and mine["indexed_keys"] > 0, mine
    assert mine["pages_built"] > 0 and mine["pages_reused"] == 0, mine
    # the same document again: its pages come from the radix cache, with their index
    assert second["account"]["pages_reused"] >= first["prompt_tokens"] // demo["page_size"] - 2, second["account"]
    assert second["account"]["sparse_steps"] > 0, second["account"]
