"""Bad input gets a clear error that names what is wrong."""

from __future__ import annotations

import math

import pytest
import torch

from louver_sgl import LouverConfig, LouverIndex, PageIndexStore
from louver_sgl.decode import louver_decode


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"eps": 0.0}, "eps"),
        ({"eps": 1.0}, "eps"),
        ({"eps": math.nan}, "eps"),
        ({"eps": math.inf}, "eps"),
        ({"budget": 0.0}, "budget"),
        ({"fixed_threshold": math.nan}, "fixed_threshold"),
        ({"dense_fallback_fraction": math.inf}, "dense_fallback_fraction"),
        ({"page_size": 48}, "power of two"),
        ({"page_size": 64, "cluster_size": 3}, "divisible by cluster_size"),
        ({"page_size": 64, "cluster_size": 16, "family": "clustered"}, None),
        ({"family": "tree"}, "family"),
        ({"grid_bits": 3}, "grid_bits"),
        ({"policy": "topk"}, "policy"),
        ({"sample_size": 0}, "sample_size"),
        ({"sink_pages": -1}, "sink_pages"),
        ({"page_size": 64.0}, "page_size"),
    ],
)
def test_config_validation(changes, match):
    if match is None:
        LouverConfig(**changes)
        return
    with pytest.raises(ValueError, match=match):
        LouverConfig(**changes)


def test_config_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown louver config keys"):
        LouverConfig.from_dict({"epsilon": 0.1})


def test_subspaces_must_divide_head_dim():
    with pytest.raises(ValueError, match="not divisible by n_subspaces"):
        LouverIndex.build(torch.randn(64, 1, 64), LouverConfig(family="clustered", n_subspaces=12))


def test_index_input_errors():
    with pytest.raises(ValueError, match=r"keys must be a tensor \[N, H_kv, D\]"):
        LouverIndex.build(torch.randn(64, 64))
    with pytest.raises(ValueError, match="dtype"):
        LouverIndex.build(torch.randn(64, 1, 64).double())
    with pytest.raises(ValueError, match="dtype"):
        LouverIndex.build(torch.ones(64, 1, 64, dtype=torch.int32))
    index = LouverIndex.build(torch.randn(128, 2, 64))
    with pytest.raises(ValueError, match="multiple of H_kv"):
        index.range_search(torch.randn(3, 64), torch.zeros(3))
    with pytest.raises(ValueError, match="head dim"):
        index.range_search(torch.randn(2, 32), torch.zeros(2))
    with pytest.raises(ValueError, match="thresholds must have shape"):
        index.range_search(torch.randn(4, 64), torch.zeros(3))
    with pytest.raises(ValueError, match="NaN"):
        index.range_search(torch.randn(4, 64), torch.tensor([0.0, math.nan, 0.0, 0.0]))


def test_decode_input_errors():
    cfg = LouverConfig(page_size=16)
    store = PageIndexStore(cfg, 4, 2, 64, torch.float32)
    k = torch.randn(64, 2, 64)
    table, lens = torch.arange(4)[None], torch.tensor([50])
    with pytest.raises(ValueError, match="q must be"):
        louver_decode(torch.randn(4, 64), k, k, table, lens, store, 0.1)
    with pytest.raises(ValueError, match="does not match"):
        louver_decode(torch.randn(1, 3, 64), k, k, table, lens, store, 0.1)
    with pytest.raises(ValueError, match="seq_lens"):
        louver_decode(torch.randn(1, 4, 64), k, k, table, torch.tensor([65]), store, 0.1)
    with pytest.raises(ValueError, match="index layout"):
        louver_decode(torch.randn(1, 4, 64), k, k, table, lens, store, 0.1, config=cfg.with_(grid_bits=4))
    with pytest.raises(ValueError, match="KV dtype"):
        PageIndexStore(cfg, 4, 2, 64, torch.float64)
