"""Accuracy vs keys attended on captured traces: louver policies and the comparison baselines.

For one trace layer, every captured query is a request (``data.paged.paged_batch``); each method
chooses an attended set and attention over that set is computed in fp64
(``louver_eval.baselines.masked_attention``), so methods differ only in which keys they keep. Per
(query, head) it records the attended fraction of all keys, the dropped softmax mass and the
relative output error ``|o - o_dense| / |o_dense|`` against fp64 dense attention.
"""

from __future__ import annotations

import numpy as np
import torch

from louver_sgl.config import LouverConfig
from .data.paged import paged_batch
from louver_sgl.decode import LouverDecode
from .baselines import baseline_attended, masked_attention
from louver_sgl.index.store import PageIndexStore
from .policies import louver_config


def layer_tradeoff(trace: dict, layer: int, louver_policies: list[str], baselines: list[str],
                   fractions: list[float], base: LouverConfig) -> dict[str, dict]:
    """``{method name: metrics}`` for one layer of ``trace`` (see ``metrics`` for the fields)."""
    batch = len(trace["query_positions"])
    pb = paged_batch(trace, layer, batch, base.page_size)
    requests = [_request(pb, b, base.page_size) for b in range(batch)]
    dense = [masked_attention(pb.q[b], k, v, torch.ones(pb.q.shape[1], len(k), dtype=torch.bool), pb.sigma)[0]
             for b, (k, v) in enumerate(requests)]
    results = {}
    for name in louver_policies:
        attended, bound = _louver_sets(pb, louver_config(name, base))
        results[name] = metrics(pb, requests, dense, attended, bound)
    for method in baselines:
        for f in fractions:
            attended = [baseline_attended(method, pb.q[b], k, f, base) for b, (k, _) in enumerate(requests)]
            results[f"{method}-{f:g}"] = metrics(pb, requests, dense, attended, None)
    return results


def _request(pb, b: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[L, H_kv, D]`` of request b in position order."""
    pos = torch.arange(int(pb.seq_lens[b]))
    slots = pb.page_table[b, pos // size] * size + pos % size
    return pb.k[slots], pb.v[slots]


def _louver_sets(pb, config: LouverConfig) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Attended masks of the louver step and its mass bound ``[B, H_q]``."""
    store = PageIndexStore(config, len(pb.k) // config.page_size, pb.k.shape[1], pb.k.shape[2], pb.k.dtype)
    store.build_pages(pb.k, torch.arange(store.num_pages))
    decode = LouverDecode(config, impl="torch").plan(pb.page_table, pb.seq_lens)
    step_result = decode.run(pb.q, pb.k, pb.v, store, pb.sigma, attended=True)
    stats, attended = step_result.stats, step_result.attended
    return attended, stats.mass_bound


def metrics(pb, requests, dense, attended, bound) -> dict:
    """Per (query, head) arrays summarised: attended fraction, dropped mass, relative output error;
    with a louver ``bound`` also how often measured <= bound."""
    frac, mass, err = [], [], []
    for b, (k, v) in enumerate(requests):
        out, dropped = masked_attention(pb.q[b], k, v, attended[b], pb.sigma)
        frac.append(attended[b].double().mean(1))
        mass.append(dropped)
        err.append((out - dense[b]).norm(dim=1) / dense[b].norm(dim=1))
    frac, mass, err = (torch.cat(x).numpy() for x in (frac, mass, err))
    row = {"query_heads": int(len(frac)), "attended_fraction": _summary(frac), "dropped_mass": _summary(mass),
           "output_rel_error": _summary(err)}
    if bound is not None:
        row["measured_le_bound"] = int((mass <= bound.reshape(-1).numpy()).sum())
        row["bound"] = _summary(bound.reshape(-1).numpy())
    return row


def _summary(x: np.ndarray) -> dict:
    return {"mean": float(x.mean()), "median": float(np.median(x)), "p90": float(np.quantile(x, 0.9)),
            "p99": float(np.quantile(x, 0.99)), "max": float(x.max()), "sum": float(x.sum()), "n": int(len(x))}
