"""The compiled CPU kernels compile at every instruction-set level they have code for.

The kernels are built with ``-march=native``, so a test run only compiles the paths of its own
machine; a change to code behind ``__AVX512F__`` is never compiled on an AVX2 machine, nor the
AVX2 paths on an AVX-512 one. Each level is checked here with ``g++ -fsyntax-only`` (templates
included), and that the expected paths are the ones selected.
"""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from conftest import skip_or_fail
from louver_sgl.profiles.device import cpu_flags

SOURCES = Path(__file__).resolve().parents[1] / "kernels" / "cpu"
# -march level -> what common.h must select there
LEVELS = {
    "x86-64": "!kHaveAvx512 && !kHaveAvx2 && !kHaveVnni",  # the plain C++ fallbacks
    "haswell": "kHaveAvx2 && !kHaveAvx512",  # AVX2 + FMA + F16C: the 8-lane paths
    "icelake-server": "kHaveAvx512 && kHaveVnni && !kHaveAvx2",  # the 16-lane and VNNI paths
}
# step.cpp includes attend.h, exact_merge.h and common.h; bounds.cpp and scan_pass.cpp page_scan.h;
# checks.cpp the rest
UNITS = ("step.cpp", "bounds.cpp", "scan_pass.cpp", "checks.cpp")


def _include_flags() -> list[str]:
    from torch.utils import cpp_extension

    return [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]


def _native_level() -> str | None:
    """The level whose paths this machine's own ``-march=native`` build compiles, if one of ours."""
    flags = cpu_flags()
    if {"avx512f", "avx512bw", "avx512_vnni"} <= flags:
        return "icelake-server"
    return "haswell" if {"avx2", "fma", "f16c"} <= flags else None


# About a minute per level on two cores: the fast tier checks the SIMD level this machine does not
# build natively; the plain fallbacks (x86-64) and the native level run in the full tier.
FULL_TIER_LEVELS = ("x86-64", _native_level())


@pytest.mark.parametrize("march", [pytest.param(m, marks=[pytest.mark.slow] if m in FULL_TIER_LEVELS else [])
                                   for m in LEVELS])
def test_kernels_compile_at_every_isa_level(march, tmp_path):
    compiler = shutil.which("g++")
    if compiler is None:
        skip_or_fail("no g++ (the kernels cannot be built here either)")
    jobs = {}
    for unit in UNITS:  # the units compile concurrently (about 20 s each)
        source = tmp_path / f"check_{unit}"
        source.write_text(f'#include "{SOURCES / unit}"\n'
                          f'static_assert({LEVELS[march]}, "wrong code paths selected for -march={march}");\n')
        cmd = [compiler, "-std=c++20", "-fsyntax-only", f"-march={march}", "-fopenmp", "-DAT_PARALLEL_OPENMP=1",
               *_include_flags(), str(source)]
        jobs[unit] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for unit, job in jobs.items():
        _, err = job.communicate()
        assert job.returncode == 0, f"{unit} does not compile with -march={march}:\n{err[-4000:]}"
