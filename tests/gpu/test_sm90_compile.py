"""Every GPU kernel compiles for an H200 (sm_90) with the Triton of the lent GPU machines.

``scripts/test.sh`` installs that Triton (3.6.0) beside the environment's own; the compile runs
in a subprocess with it first on the path (``benchmarks/compile_sm90.py``: a driver stand-in,
Triton's real front end, NVIDIA passes and ptxas). A compile error here is one the first GPU run
would hit. bf16 KV (the GPU serving dtype) over both implementations and every policy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import skip_or_fail

ROOT = Path(__file__).resolve().parents[2]
# every implementation of benchmarks/compile_sm90.py, in two halves of about equal compile time
IMPL_HALVES = (("triton", "triton_stream"), ("triton_tiled", "triton_tiled_atomic"))
GPU_TRITON = ROOT / os.environ.get("LOUVER_VENV", ".venv") / "triton-3.6.0"  # scripts/test.sh installs it


def test_every_kernel_compiles_for_sm90_with_the_gpu_machines_triton(tmp_path):
    if not (GPU_TRITON / "triton").is_dir():
        skip_or_fail(f"Triton 3.6.0 is not installed in {GPU_TRITON} (scripts/test.sh installs it)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(GPU_TRITON), str(ROOT), env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    # two compiles side by side (a compile is one core's work): half the wall time on two cores
    jobs = []
    for part, impls in enumerate(IMPL_HALVES):
        out = tmp_path / f"sm90_{part}.json"
        cmd = [sys.executable, "-m", "benchmarks.compile_sm90", "--dtypes", "bfloat16", "--impls", *impls,
               "--out", str(out)]
        jobs.append((out, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                           text=True)))
    compiled = []
    for out, job in jobs:
        log, _ = job.communicate(timeout=1200)
        assert job.returncode == 0, log[-8000:]
        result = json.loads(out.read_text())
        assert result["triton"] == "3.6.0" and result["arch"] == 90 and not result["failures"]
        compiled += result["compiled"]
    names = {row["kernel"] for row in compiled}
    for kernel in ("_exact_part_kernel", "_certified_hist_kernel", "_certified_threshold_kernel", "_attend_kernel",
                   "_merge_kernel", "_filter_kernel", "_attend_survivors_kernel", "_grid_build_kernel",
                   "_tile_filter_kernel", "_compact_kernel", "_window_threshold_kernel", "_tiled_attend_kernel"):
        assert kernel in names, kernel
    assert all(row["cubin_bytes"] > 0 and row["target"] == "cuda:90" for row in compiled)
