"""Faults the product survives: the compiled kernels failing to build, a NaN in the KV cache."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_a_failing_kernel_build_falls_back_to_the_torch_implementation(tmp_path):
    """With no working C++ compiler (CXX points at one that fails) and an empty kernel cache, the
    compiled implementation is unavailable with one warning, ``auto`` picks ``torch``, and the
    step still runs."""
    script = textwrap.dedent("""
        import logging, torch
        logging.basicConfig(level=logging.WARNING)
        from louver_sgl import LouverConfig, PageIndexStore
        from louver_sgl.decode import LouverDecode, available_implementations
        assert "cpu" not in available_implementations("cpu")
        config = LouverConfig(page_size=16)
        k = torch.randn(64, 2, 64)
        store = PageIndexStore(config, 4, 2, 64, torch.float32)
        store.build_pages(k, torch.arange(4))
        decode = LouverDecode(config)
        assert decode.impl_name == "torch", decode.impl_name
        out = decode.plan(torch.tensor([[0, 1, 2, 3]]), torch.tensor([60])).run(torch.randn(1, 4, 64), k, k, store, 0.125).out
        assert bool(torch.isfinite(out).all())
        print("served by", decode.impl_name)
    """)
    env = {"PATH": "/usr/bin:/bin", "CXX": "/bin/false", "LOUVER_KERNEL_CACHE": str(tmp_path / "cache"),
           "HOME": str(tmp_path), "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "served by torch" in proc.stdout
    assert proc.stderr.count("louver CPU kernels unavailable, using the torch path") == 1
