"""How fast could a louver step be on this machine? Bytes-only floor vs the real step and dense.

For one captured trace, layer and batch, the real louver step (budget policy) runs once to count
what it reads: code pages, union-candidate K rows, attended V rows. A compiled loop then reads the
same number of bytes in the same pattern (each kept page's codes in page-table order, then that
page's share of K and V rows; the rows are random slots, sorted per page, because the step does not
export its candidate slots) and does nothing else: the time any kernel reading those bytes needs at
least. Dense (the fastest variant of decode_cpu), the louver step and the floor are timed in
alternation with every cache swept before each call (as between layers of a real decode), and the
louver step also back to back with warm caches (its compute without memory stalls).

    python -m benchmarks.cpu.memory_floor_cpu --trace data/traces/bible_32768.pt --layers 9 21 \\
        --out benchmarks/results/memory_floor_cpu.json
"""

from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path

import torch

from louver_kernels.cpu_ops import cpu_model_name
from louver_sgl import LouverConfig, PageIndexStore
from louver_eval.data.paged import load_trace, paged_batch
from louver_sgl.decode import LouverDecode
from louver_sgl.decode.plan import plan_decode

from benchmarks.cpu.decode_cpu import dense_variants, timeit, timeit_alternating

_TOUCH_SRC = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>

// Sum of every 64-byte line of: the code pages page_ids [NP] (page_bytes each) and, after each
// page, its share (by position) of the rows k_rows [NK] and v_rows [NV] (row_bytes each) of k / v.
// Pages are split statically over the threads. Returns the sum so that no load is optimised away.
int64_t touch(torch::Tensor codes, torch::Tensor page_ids, int64_t page_bytes, torch::Tensor k_rows,
              torch::Tensor v_rows, torch::Tensor k, torch::Tensor v, int64_t row_bytes) {
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const int64_t *pid = page_ids.data_ptr<int64_t>(), *kr = k_rows.data_ptr<int64_t>(),
                *vr = v_rows.data_ptr<int64_t>();
  const uint8_t *kb = static_cast<const uint8_t*>(k.data_ptr()), *vb = static_cast<const uint8_t*>(v.data_ptr());
  const int64_t np = page_ids.size(0), nk = k_rows.size(0), nv = v_rows.size(0);
  int64_t total = 0;
#pragma omp parallel num_threads(at::get_num_threads()) reduction(+ : total)
  {
    // One 64-byte line per step: one zmm load where the build has AVX-512, two ymm loads where it
    // has AVX2 only (the sum of the int32 words is the same either way).
#ifdef __AVX512F__
    __m512i acc = _mm512_setzero_si512();
    auto lines = [&acc](const uint8_t* p, int64_t n) {
      for (int64_t o = 0; o < n; o += 64) acc = _mm512_add_epi32(acc, _mm512_loadu_si512(p + o));
    };
#else
    __m256i acc = _mm256_setzero_si256();
    auto lines = [&acc](const uint8_t* p, int64_t n) {
      for (int64_t o = 0; o < n; o += 64) {
        acc = _mm256_add_epi32(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + o)));
        acc = _mm256_add_epi32(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + o + 32)));
      }
    };
#endif
    const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
    for (int64_t i = np * id / nt; i < np * (id + 1) / nt; ++i) {
      lines(c + pid[i] * page_bytes, page_bytes);
      for (int64_t j = nk * i / np; j < nk * (i + 1) / np; ++j) lines(kb + kr[j] * row_bytes, row_bytes);
      for (int64_t j = nv * i / np; j < nv * (i + 1) / np; ++j) lines(vb + vr[j] * row_bytes, row_bytes);
    }
#ifdef __AVX512F__
    total += _mm512_reduce_add_epi32(acc);
#else
    alignas(32) int32_t words[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(words), acc);
    int32_t sum = 0;  // wraps like the zmm lanes would (the reference is modulo 2^32)
    for (int32_t w : words) sum = static_cast<int32_t>(static_cast<uint32_t>(sum) + static_cast<uint32_t>(w));
    total += sum;
#endif
  }
  return total;
}
"""


def touch_ops():
    """The compiled read-only loop (built once per process, ~30 s)."""
    from torch.utils.cpp_extension import load_inline

    return load_inline("louver_memory_floor", cpp_sources=_TOUCH_SRC, functions=["touch"],
                       extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)


def touch_reference(codes, page_ids, page_bytes, k_rows, v_rows, k, v, row_bytes) -> int:
    """Plain-torch value of ``touch`` modulo 2^32 (the kernel sums in wrapping 32-bit lanes):
    the sum of the same lines read as int32 words."""
    flat = lambda t: t.contiguous().view(torch.uint8).reshape(-1)
    pieces = [(flat(codes), page_ids, page_bytes), (flat(k), k_rows, row_bytes), (flat(v), v_rows, row_bytes)]
    total = 0
    for buf, ids, width in pieces:
        for i in ids.tolist():
            total += int(buf[i * width: (i + 1) * width].view(torch.int32).to(torch.int64).sum())
    return total % 2**32


def access_pattern(stats, store: PageIndexStore, plan, seed: int = 0):
    """(code page ids [NP], K rows [NK], V rows [NV]) int64 with the step's counts: as many of the
    plan's pages as it read codes of (the first ones; page bounds skip none on these traces), and as
    many random (slot, KV head) rows of its indexed pages as it read candidate keys and values (each
    page's rows together, in page-table order, as the step visits them)."""
    gen = torch.Generator().manual_seed(seed)
    size, h_kv = store.page_size, store.num_kv_heads
    pages = plan.page_ids
    rows = ((pages[:, None] * size + torch.arange(size)).reshape(-1, 1) * h_kv + torch.arange(h_kv)).reshape(-1)
    n_k, n_v = int(stats.union_candidates.sum()), int(stats.values_read.sum())
    k_rows = rows[torch.randperm(len(rows), generator=gen)[:n_k]]
    v_rows = k_rows[torch.randperm(n_k, generator=gen)[:n_v]]
    position = torch.empty(int(rows.max()) + 1, dtype=torch.long)
    position[rows] = torch.arange(len(rows))
    k_rows = k_rows[torch.argsort(position[k_rows])]
    v_rows = v_rows[torch.argsort(position[v_rows])]
    return pages[: int(stats.pages_read.sum())], k_rows, v_rows


def timed_cold(fns: dict, rounds: int, sweep_mb: int = 96) -> dict:
    """Median ms of each function, called in alternation with every cache swept before each call."""
    sweep = torch.ones(sweep_mb << 20, dtype=torch.uint8)
    return timeit_alternating(fns, rounds, before=lambda: sweep.add_(1))


def run_case(trace, layer: int, batch: int, index_kw: dict, budget: float, rounds: int, ops,
             huge_pages: bool = True) -> dict:
    cfg = LouverConfig(**index_kw, policy="budget", budget=budget)
    pb = paged_batch(trace, layer, batch, cfg.page_size, huge_pages=huge_pages)
    store = PageIndexStore(cfg, len(pb.k) // cfg.page_size, pb.k.shape[1], pb.k.shape[2], pb.k.dtype)
    plan = plan_decode(pb.page_table, pb.seq_lens, cfg)
    store.build_pages(pb.k, plan.page_ids)
    decode = LouverDecode(cfg, "cpu").plan(pb.page_table, pb.seq_lens)
    step = lambda: decode.run(pb.q, pb.k, pb.v, store, pb.sigma, stats=True)
    stats = step().stats
    pages, k_rows, v_rows = access_pattern(stats, store, plan)
    codes = store.tensors["codes"]
    page_bytes = store.code_bytes_per_page()
    row_bytes = pb.k.shape[2] * pb.k.element_size()
    floor = lambda: ops.touch(codes, pages, page_bytes, k_rows, v_rows, pb.k, pb.v, row_bytes)
    variants = dense_variants(pb, huge_pages)
    best = min(variants, key=lambda n: timeit(variants[n], 5))
    cold = timed_cold({"dense": variants[best], "louver": step, "floor": floor}, rounds)
    floor_bytes = len(pages) * page_bytes + (len(k_rows) + len(v_rows)) * row_bytes
    dense_bytes = int(pb.seq_lens.sum()) * pb.k.shape[1] * 2 * pb.k.shape[2] * pb.k.element_size()
    return {
        "layer": layer, "batch": batch, "length": int(pb.seq_lens.max()), "index": index_kw, "budget": budget,
        "huge_pages": huge_pages,
        "best_dense": best, "dense_ms": cold["dense"], "louver_ms": cold["louver"], "floor_ms": cold["floor"],
        "louver_warm_ms": timeit(step, rounds, warmup=2),
        "floor_bytes": floor_bytes, "dense_bytes": dense_bytes,
        "speedup": cold["dense"] / cold["louver"], "speedup_at_floor": cold["dense"] / cold["floor"],
        "union_candidate_fraction": float(stats.union_candidates.sum() / (stats.num_indexed.sum() * pb.k.shape[1])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="data/traces/bible_32768.pt")
    parser.add_argument("--layers", type=int, nargs="+", default=[9, 21])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--budget", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--out", default="benchmarks/results/memory_floor_cpu.json")
    parser.add_argument("--no-huge-pages", action="store_true", help="keep K/V (both sides) on 4 KiB pages")
    args = parser.parse_args()
    ops = touch_ops()
    trace = load_trace(args.trace)
    indexes = [{"family": "grid", "grid_bits": 8}, {"family": "grid", "grid_bits": 4},
               {"family": "grid", "grid_bits": 4, "page_size": 128}]
    cases = []
    for layer in args.layers:
        for index_kw in indexes:
            case = run_case(trace, layer, args.batch, index_kw, args.budget, args.rounds, ops,
                            huge_pages=not args.no_huge_pages)
            cases.append(case)
            print(f"layer {layer} {index_kw}: dense {case['dense_ms']:.3f} ms, louver {case['louver_ms']:.3f} ms "
                  f"({case['speedup']:.2f}x), floor {case['floor_ms']:.3f} ms ({case['speedup_at_floor']:.2f}x), "
                  f"louver warm {case['louver_warm_ms']:.3f} ms", flush=True)
    result = {"date": date.today().isoformat(), "cpu": cpu_model_name(), "threads": torch.get_num_threads(),
              "command": "python -m benchmarks.cpu.memory_floor_cpu " + " ".join(
                  f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                  for k, v in vars(args).items()),
              "cases": cases}
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
