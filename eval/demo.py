"""Demo of the louver core on real SmolLM2 query/key traces.

Fetches the offline model and texts, captures post-RoPE traces (first run only, a few minutes),
then runs the batched decode step with each threshold policy on every captured layer and prints,
per policy: keys attended, the certified bound on dropped softmax mass, the measured dropped mass,
the output error against dense attention, recall of {q·k >= T} against an fp64 brute force (always
1.0), and the step time relative to dense attention in the same run.

    python -m louver_eval.demo [--lengths 2048 8192] [--text bible]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from louver_sgl import LouverConfig, PageIndexStore
from louver_eval.data.capture import DEFAULT_LAYERS, ensure_traces
from louver_eval.data.paged import PagedBatch, load_trace, paged_batch
from louver_sgl.decode import louver_decode
from louver_sgl.decode.reference import reference_decode

POLICIES = [
    ("dense", {"policy": "dense"}),
    ("certified eps=1e-2", {"policy": "certified", "eps": 1e-2, "grid_bits": 8}),
    ("certified eps=1e-3", {"policy": "certified", "eps": 1e-3, "grid_bits": 8}),
    ("budget f=0.05", {"policy": "budget", "budget": 0.05}),
    ("budget f=0.10", {"policy": "budget", "budget": 0.1}),
]


def _dense_probs(pb: PagedBatch, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 dense softmax ``[H_q, L]`` and output ``[H_q, D]`` of request b."""
    size = len(pb.k) // pb.page_table.numel()
    n = int(pb.seq_lens[b])
    pos = torch.arange(n)
    slots = pb.page_table[b, pos // size] * size + pos % size
    groups = pb.q.shape[1] // pb.k.shape[1]
    k = pb.k[slots].double().repeat_interleave(groups, 1)
    v = pb.v[slots].double().repeat_interleave(groups, 1)
    p = torch.softmax(pb.sigma * torch.einsum("hd,lhd->hl", pb.q[b].double(), k), dim=1)
    return p, torch.einsum("hl,lhd->hd", p, v)


def evaluate(pb: PagedBatch, config: LouverConfig) -> dict:
    store = PageIndexStore(config, len(pb.k) // config.page_size, pb.k.shape[1], pb.k.shape[2], pb.k.dtype)
    store.build_pages(pb.k, torch.arange(store.num_pages))
    start = time.perf_counter()
    out, stats = louver_decode(pb.q, pb.k, pb.v, pb.page_table, pb.seq_lens, store, pb.sigma)
    step_s = time.perf_counter() - start
    _, info = reference_decode(pb.q, pb.k, pb.v, pb.page_table, pb.seq_lens, store, pb.sigma)
    dropped, err, hit, need = 0.0, 0.0, 0, 0
    for b in range(len(pb.seq_lens)):
        p, dense_out = _dense_probs(pb, b)
        dropped = max(dropped, float((p * ~info[b]["attended"]).sum(1).max()))
        err = max(err, float((out[b].double() - dense_out).norm(dim=-1).max()))
        hit_b, need_b = _recall_counts(pb, b, stats.threshold[b], info[b]["attended"])
        hit, need = hit + hit_b, need + need_b
    return {"attended": float(stats.candidates.sum() / (stats.num_indexed.sum().clamp(min=1) * pb.q.shape[1])),
            "bound": float(stats.mass_bound.max()), "dropped": dropped, "error": err,
            "recall": 1.0 if need == 0 else hit / need, "step_s": step_s, "fallbacks": int(stats.dense_fallback.sum())}


def _recall_counts(pb: PagedBatch, b: int, threshold: torch.Tensor, attended: torch.Tensor) -> tuple[int, int]:
    size = len(pb.k) // pb.page_table.numel()
    n = int(pb.seq_lens[b])
    pos = torch.arange(n)
    slots = pb.page_table[b, pos // size] * size + pos % size
    groups = pb.q.shape[1] // pb.k.shape[1]
    s = torch.einsum("hd,lhd->hl", pb.q[b].double(), pb.k[slots].double().repeat_interleave(groups, 1))
    must = s >= threshold.double()[:, None]
    return int((must & attended).sum()), int(must.sum())


def dense_time(pb: PagedBatch, repeats: int = 3) -> float:
    size = len(pb.k) // pb.page_table.numel()
    groups = pb.q.shape[1] // pb.k.shape[1]
    rows = []
    for b, n in enumerate(pb.seq_lens.tolist()):
        pos = torch.arange(n)
        slots = pb.page_table[b, pos // size] * size + pos % size
        rows.append((pb.k[slots].float().permute(1, 0, 2).repeat_interleave(groups, 0),
                     pb.v[slots].float().permute(1, 0, 2).repeat_interleave(groups, 0)))
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for b, (k, v) in enumerate(rows):
            torch.nn.functional.scaled_dot_product_attention(pb.q[b][:, None], k, v, scale=pb.sigma)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--text", default="bible", choices=["bible", "paul_graham"])
    parser.add_argument("--layers", type=int, nargs="+", default=None, help="default: every captured layer")
    parser.add_argument("--batch", type=int, default=4, help="requests per decode batch")
    args = parser.parse_args()
    torch.manual_seed(0)
    paths = ensure_traces(args.lengths, list(DEFAULT_LAYERS), args.text)
    print(f"\n{'tokens':>6} {'layer':>5} {'policy':20} {'attended':>8} {'bound':>9} {'dropped':>9} "
          f"{'|err|':>8} {'recall':>6} {'fb':>2} {'time/dense':>10}")
    for path in paths:
        trace = load_trace(path)
        for layer in args.layers or sorted(trace["keys"]):
            pb = paged_batch(trace, layer, args.batch, 64)
            dense_s = dense_time(pb)
            for name, kw in POLICIES:
                r = evaluate(pb, LouverConfig(**kw))
                print(f"{trace['meta']['length']:6d} {layer:5d} {name:20} {r['attended']:8.3f} {r['bound']:9.2e} "
                      f"{r['dropped']:9.2e} {r['error']:8.2e} {r['recall']:6.3f} {r['fallbacks']:2d} "
                      f"{r['step_s'] / dense_s:10.2f}")
                if r["recall"] != 1.0:
                    raise SystemExit(f"recall below 1.0 for {name} at layer {layer}: a bug")
    print("\nattended = indexed keys attended per head (fraction); bound = certified upper bound on the "
          "dropped softmax mass; dropped = measured (fp64); recall of {q·k >= T} vs fp64 brute force; "
          "fb = requests that fell back to dense; time/dense = step time over dense SDPA (same run).")


if __name__ == "__main__":
    main()
