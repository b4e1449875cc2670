"""Build FlashInfer's JIT decode kernels for the shapes ``gpu_bench.py`` times (runs in the
background of ``gpu_check.sh`` so that the compile overlaps the kernel tests)."""

from __future__ import annotations

import sys
import time

import torch

from benchmarks.gpu_bench import SHAPES, PagedCase, flashinfer_method, load_layer


def main(trace: str, dtype: str = "bfloat16") -> None:
    layer = load_layer(trace)
    for shape in SHAPES:
        t0 = time.time()
        case = PagedCase(layer, shape, 1024, 2, 64, getattr(torch, dtype))
        out = torch.empty_like(case.q)
        flashinfer_method(case, out)()
        torch.cuda.synchronize()
        print(f"flashinfer {shape}: built and ran in {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
