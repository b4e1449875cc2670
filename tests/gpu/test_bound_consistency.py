"""The certified Triton steps evaluate a page's bounds in more than one kernel: the histogram
pass, the attend pass and the a-posteriori band pass. Their sums may round differently where the
compiled layouts differ (another warp count, another variant of a kernel), which the interpreter
cannot show (it sums in one order). What keeps the certificate and recall exact anyway:

* the histogram places each unit at the bin of its bound lowered by ``order_envelopes``, how far
  another kernel's evaluation of that bound can lie below it, so every unit a gate drops at an
  edge is counted below it;
* the band pass is the first pass's very binary (its band is a runtime flag), so a key is in the
  band exactly when the first pass left it out;
* ``triton_stream`` runs the fused kernels' step for the a-posteriori rule (a band over its
  filter's lists would recompute the bounds in another kernel).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conftest import SLOW_WHERE_INTERPRETED, make_paged  # noqa: E402
from louver_kernels.triton import grid_decode, stream_decode  # noqa: E402
from louver_kernels.triton.launch import TritonLaunch  # noqa: E402
from louver_sgl import LouverConfig, PageIndexStore  # noqa: E402
from louver_sgl.decode import LouverDecode  # noqa: E402

pytestmark = SLOW_WHERE_INTERPRETED  # the full tier where there is no CUDA (conftest)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class _Recorder:
    """Stands in for a ``triton.jit`` kernel: records each launch's compile-time arguments."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append({k: v for k, v in kwargs.items() if k.isupper() or k.startswith("num_")})
            return self.kernel[grid](*args, **kwargs)
        return launch


def _a_posteriori_step(impl, monkeypatch, kernels):
    recorders = {}
    for module, name in kernels:
        recorders[name] = _Recorder(getattr(module, name))
        monkeypatch.setattr(module, name, recorders[name])
    config = LouverConfig(page_size=16, policy="certified", eps=0.05, certified_rule="a_posteriori", sample_size=32,
                          estimate_share=4.0)
    k, v, table, lens = make_paged([700, 300], 16, 2, 64, seed=4)
    store = PageIndexStore(config, len(k) // 16, 2, 64, torch.float32, DEVICE, code_layout="token")
    store.build_pages(k.to(DEVICE), torch.arange(store.num_pages, device=DEVICE))
    q = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(5)) * 2
    decode = LouverDecode(config, DEVICE, impl=impl, launch=TritonLaunch(pages_per_split=4, hist_warps=8,
                                                                        attend_warps=2, filter_warps=8))
    decode.plan(table.to(DEVICE), lens.to(DEVICE)).run(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), store, 0.125)
    return recorders


def test_the_band_pass_runs_the_first_passs_binary(monkeypatch):
    attend = _a_posteriori_step("triton", monkeypatch, [(grid_decode, "_attend_kernel")])["_attend_kernel"]
    first, band = attend.launches[:2]  # the first pass, then the band pass
    assert len(attend.launches) == 2
    assert first == band, "the band pass compiles another variant: its bounds may round otherwise"


def test_the_streaming_step_runs_the_fused_step_for_the_a_posteriori_rule(monkeypatch):
    recorders = _a_posteriori_step("triton_stream", monkeypatch,
                                   [(grid_decode, "_attend_kernel"), (stream_decode, "_filter_kernel")])
    assert not recorders["_filter_kernel"].launches
    launches = recorders["_attend_kernel"].launches
    assert len(launches) == 2 and launches[0] == launches[1]


def _page_terms_orders(q, lo, sc, rad, bits):
    """Offsets and page bounds of one page summed in three orders (forward, backward, pairwise),
    fp32, as ``grid_bounds.page_terms`` defines them before its slack."""
    levels = 1 << bits
    c_min, c_max = lo + 0.5 * sc, lo + (levels - 0.5) * sc
    terms_off = torch.cat([q * c_min, q.abs() * rad], -1)
    terms_pb = torch.cat([torch.maximum(q * c_min, q * c_max), q.abs() * rad], -1)

    def orders(t):
        fwd = torch.zeros(t.shape[0])
        bwd = torch.zeros(t.shape[0])
        for j in range(t.shape[1]):
            fwd = fwd + t[:, j]
            bwd = bwd + t[:, t.shape[1] - 1 - j]
        return torch.stack([fwd, bwd, t.sum(1)])

    return orders(terms_off), orders(terms_pb)


@pytest.mark.parametrize("seed", range(4))
def test_the_slack_covers_two_summation_orders(seed):
    """Two evaluation orders of a page's offset and page bound differ by less than twice the
    slack ``page_terms`` adds (the histogram lowers placements by three times it), on terms of
    large cancelling magnitude."""
    gen = torch.Generator().manual_seed(seed)
    dim, bits = 128, 8
    q = torch.randn(4, dim, generator=gen) * 30
    lo = torch.randn(dim, generator=gen) * 1e3
    sc = torch.rand(dim, generator=gen) * 10
    rad = torch.rand(dim, generator=gen) * sc / 2
    off, pb = _page_terms_orders(q, lo, sc, rad, bits)
    magnitude = (q.abs() * (lo.abs() + (1 << bits) * sc.abs() + rad)).double().sum(1)
    terms = 2 * dim + 2 + 8
    slack = magnitude * 2 * terms * 2.0 ** -24
    for x in (off, pb):
        spread = (x.double().amax(0) - x.double().amin(0))
        assert bool((spread <= 2 * slack).all()) and bool((spread > 0).any()), "the orders must differ here"
        assert not math.isnan(float(spread.sum()))
