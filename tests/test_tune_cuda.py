"""The CUDA tuning target without a GPU: its launch space, defaults and step (Triton interpreter)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conftest import make_paged  # noqa: E402
from louver_kernels.triton.launch import TritonLaunch  # noqa: E402
from louver_sgl import LouverConfig, PageIndexStore  # noqa: E402
from louver_eval.data.paged import PagedBatch  # noqa: E402
from louver_sgl.decode import louver_decode  # noqa: E402
from louver_tuning.cuda import LAUNCH_CHOICES, CudaEventTimer, CudaTarget  # noqa: E402
from louver_tuning.targets import get_target  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_every_launch_point_is_valid_and_defaults_are_in_the_space():
    target = CudaTarget(device=DEVICE)
    space = target.launch_space()
    kernel_keys = [k for k in space if k != "cuda_decode"]
    for key in kernel_keys:  # each knob's every value beside the others' defaults, then all extremes
        for value in space[key].choices:
            TritonLaunch.from_dict({key: value})
    for pick in (min, max):
        TritonLaunch.from_dict({k: pick(space[k].choices) for k in kernel_keys})
    assert set(space["cuda_decode"].choices) == {"triton", "triton_stream", "triton_tiled"}
    defaults = target.default_launch()
    assert all(defaults[k] in LAUNCH_CHOICES[k] for k in defaults)
    assert isinstance(get_target("cuda"), CudaTarget)
    with pytest.raises(ValueError):
        CudaEventTimer(repeats=0)


def test_step_runs_the_gpu_decode_with_the_trial_launch():
    config = LouverConfig(page_size=16, policy="budget", budget=0.1, sample_size=32)
    k, v, table, lens = make_paged([200, 90], 16, 2, 64, dtype=torch.float16)
    q = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(3))
    target = CudaTarget(device=DEVICE)
    batch = target.place(PagedBatch(q, k, v, table, lens, 0.125))
    store = PageIndexStore(config, len(k) // 16, 2, 64, torch.float16, device=DEVICE, code_layout="token")
    store.build_pages(batch.k.cpu() if DEVICE == "cpu" else batch.k, torch.arange(store.num_pages, device=DEVICE))
    out, stats = target.make_step(batch, store, config, {"pages_per_split": 4, "attend_warps": 2})()
    want, _ = louver_decode(q.half().to(DEVICE), batch.k, batch.v, batch.page_table, batch.seq_lens, store,
                            0.125, config, impl="triton", launch=TritonLaunch(pages_per_split=4, attend_warps=2))
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    assert stats.candidates.shape == (2, 6)
    short, _ = target.make_step(batch, store, config.with_(min_sparse_tokens=128), {})()  # request 1 is dense
    dense, _ = target.make_step(batch, store, config.with_(policy="dense"), {})()
    torch.testing.assert_close(short[1], dense[1], atol=2e-3, rtol=2e-3)


def test_cuda_studies_search_the_grid_family_only():
    """The study space of the CUDA target keeps the bound family its kernels read at one value."""
    from louver_tuning.space import build_space

    target = CudaTarget(device=DEVICE)
    space = build_space(target.launch_space(), 32768).restrict(target.fixed_config)
    assert space.distributions["family"].choices == ("grid",)
    assert len(space.distributions["min_sparse_tokens"].choices) > 1  # the kernels honour it
