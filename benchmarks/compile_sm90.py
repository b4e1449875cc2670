"""Compile every Triton kernel of the GPU path for an H200 (sm_90) on a machine without a GPU.

The step wrappers run on CPU tensors as they would on CUDA ones, but every kernel launch only
compiles (``JITFunction.run`` with ``warmup=True``) against a driver stand-in that names the
target: Triton's front end, its NVIDIA passes and ptxas (bundled with Triton) run for real, so a
kernel that would fail to compile on the GPU machine fails here. Run it with the Triton version
of the GPU machine first on the path (3.6.0 on the lent H200s):

    pip install --target /tmp/triton36 --no-deps triton==3.6.0
    PYTHONPATH=/tmp/triton36 python -m benchmarks.compile_sm90 --out /tmp/sm90.json

Covered: the page build (2/4/8-bit codes), and for ``triton`` and ``triton_stream`` every policy
and certified rule (the a-posteriori band pass; ``triton_stream`` also the one-pass rule), for
``triton_tiled`` every policy it runs, with ordered and atomic lists (``triton_tiled_atomic``),
fp16/bf16/fp32 KV, head dims 64 and 128, GQA groups 3 and 4, 4- and 8-bit codes, the value gate
and the dense fallback pass. Prints one line per distinct compiled kernel (shared memory, warps,
stages, cubin bytes) and exits non-zero if any compile failed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be real JIT functions, not interpreted

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402
from benchmarks.record import write_result


class CompileOnlyDriver:
    """The parts of Triton's active driver that compiling (not launching) asks for."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def set_current_device(self, device: int) -> None:
        return None

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


COMPILED: dict[str, dict] = {}


def _compile_only(original):
    def run(self, *args, grid, warmup, **kwargs):
        kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
        meta = kernel.metadata
        key = f"{self.__name__} warps={meta.num_warps} stages={meta.num_stages} hash={meta.hash[:10]}"
        COMPILED[key] = dict(kernel=self.__name__, shared=meta.shared, num_warps=meta.num_warps,
                             num_stages=meta.num_stages, cubin_bytes=len(kernel.asm.get("cubin", b"")),
                             target=f"{meta.target.backend}:{meta.target.arch}",
                             **resource_usage(kernel.asm.get("cubin", b"")))
        if not kernel.asm.get("cubin"):
            raise RuntimeError(f"{self.__name__}: no cubin produced")
        return kernel
    return run


def resource_usage(cubin: bytes) -> dict:
    """Registers, spill stores/loads and stack frame of a cubin (the cuobjdump bundled with
    Triton); empty where it cannot be read."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cubin or not tool.is_file():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}
    return {"registers": found.get("REG"), "stack_bytes": found.get("STACK"), "local_bytes": found.get("LOCAL")}


def _case(dtype, dim, groups, page):
    h_kv, lens = 2, [700, 129]
    pages = sum(-(-n // page) for n in lens)
    k = torch.randn(pages * page, h_kv, dim).to(dtype)
    v = torch.randn(pages * page, h_kv, dim).to(dtype)
    width = max(-(-n // page) for n in lens)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    start = 0
    for b, n in enumerate(lens):
        count = -(-n // page)
        table[b, :count] = torch.arange(start, start + count)
        start += count
    q = torch.randn(len(lens), h_kv * groups, dim).to(dtype)
    return q, k, v, table, torch.tensor(lens, dtype=torch.int32)


# launch variants compiled as implementations of their own
VARIANTS = {"triton_tiled_atomic": ("triton_tiled", {"tile_atomic": 1})}
# what each implementation refuses by name
REFUSED = {"triton": {"certified-one-pass"}, "triton_tiled": {"certified-one-pass", "certified-a-posteriori"}}


def compile_step(impl: str, policy: str, dtype, dim: int, groups: int, bits: int, fallback: bool) -> None:
    from louver_kernels.triton.grid_build import grid_build
    from louver_sgl import LouverConfig
    from louver_sgl.decode.api import implementation
    from louver_sgl.decode.contract import Capacity
    from louver_sgl.index.store import PageIndexStore

    page = 64
    passes = 1 if policy == "certified-one-pass" else 2
    rule = "a_posteriori" if policy == "certified-a-posteriori" else "histogram"
    config = LouverConfig(page_size=page, policy=policy.split("-")[0], grid_bits=bits, eps=1e-3,
                          budget=0.05, fixed_threshold=1.0, sample_size=64, certified_passes=passes,
                          certified_rule=rule, dense_fallback_fraction=0.5 if fallback else 1.0)
    q, k, v, table, lens = _case(dtype, dim, groups, page)
    store = PageIndexStore(config, k.shape[0] // page, k.shape[1], dim, dtype, code_layout="token")
    t = store.tensors
    grid_build(k, torch.arange(store.num_pages), t["lo"], t["scale"], t["radius"], t["codes"], page, bits)
    impl, launch = VARIANTS.get(impl, (impl, None))
    decode = implementation(impl)(config, torch.device("cpu"), launch, None, Capacity(None, None))
    plan = decode.plan(table, lens)
    decode.run(plan, q=q, k_cache=k, v_cache=v, store=store, sigma=dim ** -0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--out", default=None)
    parser.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16", "float32"],
                        help="KV dtypes compiled (CI compiles bfloat16 only, the dtype served on GPUs)")
    parser.add_argument("--impls", nargs="+", default=["triton", "triton_stream", "triton_tiled", "triton_tiled_atomic"])
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    driver.set_active(CompileOnlyDriver(GPUTarget("cuda", args.arch, 32)))
    JITFunction.run = _compile_only(JITFunction.run)
    failures = []
    policies = ["certified", "certified-one-pass", "certified-a-posteriori", "budget", "fixed", "dense"]
    cases = list(itertools.product(args.impls, policies,
                                   [getattr(torch, d) for d in args.dtypes], [64, 128], [3, 4], [4, 8],
                                   [False, True]))
    # every option once per implementation and dtype, not the whole product (compiles take seconds each)
    chosen = [c for c in cases if (c[3] == 64) == (c[4] == 3) and (c[5] == 8) == (c[6] is False)
              and c[1] not in REFUSED.get(VARIANTS.get(c[0], (c[0],))[0], ())]
    for impl, policy, dtype, dim, groups, bits, fallback in chosen:
        try:
            compile_step(impl, policy, dtype, dim, groups, bits, fallback)
        except Exception:
            failures.append(dict(impl=impl, policy=policy, dtype=str(dtype), dim=dim, groups=groups, bits=bits,
                                 fallback=fallback, error=traceback.format_exc(limit=4)))
            print("FAILED", failures[-1], flush=True)
    for key, row in sorted(COMPILED.items()):
        print(json.dumps(row))
    result = dict(triton=triton.__version__, arch=args.arch, cases=len(chosen), kernels=len(COMPILED),
                  failures=failures, compiled=sorted(COMPILED.values(), key=lambda r: r["kernel"]))
    if args.out:
        write_result(args.out, result)
    print(f"triton {triton.__version__}: {len(COMPILED)} kernels compiled for sm_{args.arch} over {len(chosen)} "
          f"step configurations, {len(failures)} failed")
    return 1 if failures or not COMPILED else 0


if __name__ == "__main__":
    sys.exit(main())
