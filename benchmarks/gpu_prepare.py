"""Prepare ``.gpu_carry/`` for ``benchmarks/gpu_check.sh`` on a machine with network access.

The GPU machine has torch and Triton but no network and no SGLang: this writes one captured layer
of the 32K-token trace, the FlashInfer wheels (JIT build there) and SGLang's Triton decode kernel
with stand-ins for the few SGLang modules it imports, so the dense baselines run there unchanged.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import torch

WHEELS = ["flashinfer-python==0.5.3", "apache-tvm-ffi==0.1.15.post2", "nvidia-cudnn-frontend==1.32.0"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any"]

ENVIRON_STUB = '''"""Stand-in for sglang.srt.environ: every flag at its default."""
class _Flag:
    def __init__(self, value):
        self.value = value
    def get(self):
        return self.value
_DEFAULTS = {"SGLANG_FORCE_LEAN_GRID_CU_MULT": 1.0}
class _Envs:
    def __getattr__(self, name):
        return _Flag(_DEFAULTS.get(name, False))
envs = _Envs()
'''

UTILS_STUB = '''"""Stand-in for the sglang.srt.utils helpers the Triton decode kernel imports."""
import torch
def get_device_core_count(device_id=0):
    return torch.cuda.get_device_properties(device_id).multi_processor_count
def is_hip():
    return False
def is_gfx95_supported():
    return False
def is_gfx1250_supported():
    return False
'''


def write_trace(src: Path, layer: int, dest: Path) -> None:
    data = torch.load(src, map_location="cpu", weights_only=True)
    subset = {k: data[k][layer].clone() for k in ("keys", "values", "queries")}
    torch.save(subset, dest)


def write_wheels(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    for wheel in WHEELS:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", *plat, "-d", str(dest), wheel],
                       check=True)


def write_sglang_kernel(dest: Path) -> None:
    import sglang

    root = Path(sglang.__file__).parent
    pkg = dest / "sglang"
    (pkg / "srt").mkdir(parents=True, exist_ok=True)
    (pkg / "kernels" / "ops" / "attention").mkdir(parents=True, exist_ok=True)
    for sub in ("", "srt", "kernels", "kernels/ops", "kernels/ops/attention"):
        (pkg / sub / "__init__.py").write_text("")
    for name in ("decode_attention.py", "score_mod.py"):
        shutil.copy(root / "kernels" / "ops" / "attention" / name, pkg / "kernels" / "ops" / "attention" / name)
    (pkg / "srt" / "environ.py").write_text(ENVIRON_STUB)
    (pkg / "srt" / "utils.py").write_text(UTILS_STUB)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trace", default="data/traces/bible_32768.pt")
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--out", default=".gpu_carry")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    write_trace(Path(args.trace), args.layer, out / "trace.pt")
    write_wheels(out / "whl")
    write_sglang_kernel(out / "shim")
    print(f"prepared {out}: {sum(f.stat().st_size for f in out.rglob('*') if f.is_file()) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
