"""CPU decode-attention benchmark on captured SmolLM2 traces: louver step vs the fastest dense path.

For each context length, layer and batch size, one run times every dense variant (SDPA and bmm in
fp32/fp16/bf16 on pre-gathered contiguous K/V: the dense side pays no gather) to pick the fastest,
then times the louver step (threshold + filter + attention, all included, on the paged fp16 KV) of
each configuration in alternation with that fastest dense variant (paired medians, so that drift of
a noisy machine hits both), and reports their latency ratios, with candidate and
page-survival fractions, bytes read, index memory, page-build cost and recall (exactness is checked
against an fp64 brute force on every timed configuration).

    python -m benchmarks.cpu.decode_cpu --traces data/traces/bible_2048.pt data/traces/bible_8192.pt \\
        data/traces/bible_32768.pt --out benchmarks/results/decode_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from louver_eval.data.paged import PagedBatch, load_trace, paged_batch
from louver_kernels.cpu_ops import cpu_model_name
from louver_sgl import LouverConfig, PageIndexStore
from louver_sgl.decode import LouverDecode
from louver_sgl.decode.plan import plan_decode, split_pages
from louver_sgl.memory import huge_copy

POLICIES = {
    "certified-1e-2": {"policy": "certified", "eps": 1e-2},
    "certified-1e-3": {"policy": "certified", "eps": 1e-3},
    "certified-1e-4": {"policy": "certified", "eps": 1e-4},
    "budget-0.05": {"policy": "budget", "budget": 0.05},
    "budget-0.1": {"policy": "budget", "budget": 0.1},
    "budget-0.25": {"policy": "budget", "budget": 0.25},
    # almost no candidates: the scan of every page's codes and the exact part alone, the floor
    # under any budget step of these kernels (docs/benchmarks.md, "The scan alone at 32K")
    "budget-0.001": {"policy": "budget", "budget": 0.001},
    # the one-pass certified rule (design notes, "Certified in one pass")
    "certified-1e-2-one-pass": {"policy": "certified", "eps": 1e-2, "certified_passes": 1},
    "certified-1e-3-one-pass": {"policy": "certified", "eps": 1e-3, "certified_passes": 1},
    # the a-posteriori certified rule (design notes, "Certified a posteriori")
    "certified-1e-2-a-posteriori": {"policy": "certified", "eps": 1e-2, "certified_rule": "a_posteriori"},
    "certified-1e-3-a-posteriori": {"policy": "certified", "eps": 1e-3, "certified_rule": "a_posteriori"},
    "certified-1e-4-a-posteriori": {"policy": "certified", "eps": 1e-4, "certified_rule": "a_posteriori"},
    "certified-1e-2-a-posteriori-s1": {"policy": "certified", "eps": 1e-2, "certified_rule": "a_posteriori",
                                       "estimate_share": 1.0},
    "certified-1e-3-a-posteriori-s1": {"policy": "certified", "eps": 1e-3, "certified_rule": "a_posteriori",
                                       "estimate_share": 1.0},
    # the one-pass rule a posteriori (design notes, "Certified a posteriori in one pass")
    "certified-1e-2-one-pass-a-posteriori": {"policy": "certified", "eps": 1e-2, "certified_passes": 1,
                                             "certified_rule": "a_posteriori"},
    "certified-1e-3-one-pass-a-posteriori": {"policy": "certified", "eps": 1e-3, "certified_passes": 1,
                                             "certified_rule": "a_posteriori"},
    # the same at other estimate shares (-s1, -s4, -s6, -s8; docs/benchmarks.md, "The a-posteriori rule's
    # estimate share")
    **{f"certified-{eps}-one-pass-a-posteriori-s{share}": {"policy": "certified", "eps": float(eps),
                                                           "certified_passes": 1, "certified_rule": "a_posteriori",
                                                           "estimate_share": float(share)}
       for share in (1, 4, 6, 8) for eps in ("1e-2", "1e-3")},
    # the histogram rule with its two scans of the codes (the compiled step's launch one_scan=False;
    # the plain names above run it in one scan, design notes "Certified in one code pass")
    "certified-1e-2-two-scans": {"policy": "certified", "eps": 1e-2, "launch": {"one_scan": False}},
    "certified-1e-3-two-scans": {"policy": "certified", "eps": 1e-3, "launch": {"one_scan": False}},
    # residual int8 weights in the compiled token bounds (launch residual_weights=True)
    "certified-1e-2-residual": {"policy": "certified", "eps": 1e-2, "launch": {"residual_weights": True}},
    "certified-1e-3-residual": {"policy": "certified", "eps": 1e-3, "launch": {"residual_weights": True}},
    "budget-0.05-residual": {"policy": "budget", "budget": 0.05, "launch": {"residual_weights": True}},
}
INDEXES = {
    "grid-8bit": {"family": "grid", "grid_bits": 8},
    "grid-4bit": {"family": "grid", "grid_bits": 4},
    # the index of the shipped CPU profile (louver_sgl/profiles/cpu_amd_epyc_avx512.json)
    "grid-4bit-p128": {"family": "grid", "grid_bits": 4, "page_size": 128},
    # the index of the AMD EPYC AVX-512 and Intel fp32 profiles
    "grid-8bit-p128": {"family": "grid", "grid_bits": 8, "page_size": 128},
    # one page-level term and one set of int8 weights per 256 tokens: half the per-page work of page 128
    "grid-8bit-p256": {"family": "grid", "grid_bits": 8, "page_size": 256},
    "clustered-S16-bf4": {"family": "clustered", "n_subspaces": 16, "cluster_size": 4},
}


def timeit(fn, repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in milliseconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def alternating_times(fns: dict, rounds: int, before=None, shuffle: bool = False, warmup_rounds: int = 0) -> dict:
    """Wall times (ms) of each function of ``fns`` per round, called in alternation so that drift
    of a noisy machine hits all alike: forward order on even rounds and reverse on odd ones, or
    (``shuffle``) a new random order every round, seeded, where a fixed or reversed order would
    keep one function next to another that evicts or warms its caches. ``before()`` runs untimed
    before every call (a cache sweep, or the dense path); ``warmup_rounds`` go untimed first."""
    names = list(fns)
    times = {name: [] for name in names}
    gen = random.Random(0)
    for r in range(warmup_rounds + rounds):
        order = gen.sample(names, len(names)) if shuffle else names if r % 2 == 0 else names[::-1]
        for name in order:
            if before is not None:
                before()
            start = time.perf_counter()
            fns[name]()
            if r >= warmup_rounds:
                times[name].append(1e3 * (time.perf_counter() - start))
    return times


def timeit_alternating(fns: dict, rounds: int, before=None, shuffle: bool = False, warmup_rounds: int = 0) -> dict:
    """Median wall time (ms) of each function of ``fns``, timed by ``alternating_times``."""
    times = alternating_times(fns, rounds, before, shuffle, warmup_rounds)
    return {name: statistics.median(t) for name, t in times.items()}


def timeit_paired(base, fn, repeats: int, slow_s: float = 0.1, slow_repeats: int = 3) -> tuple[float, float, float]:
    """Median wall times (ms) of ``base()`` and ``fn()`` timed in alternation, so that drift of a
    noisy machine hits both alike, and the median over rounds of base's time over fn's in the
    same round (a ratio that drift slower than a round leaves alone). Steps slower than
    ``slow_s`` get ``slow_repeats`` rounds."""
    base()
    start = time.perf_counter()
    fn()
    rounds = repeats if time.perf_counter() - start < slow_s else slow_repeats
    times = alternating_times({"base": base, "fn": fn}, rounds)
    ratio = statistics.median(b / max(f, 1e-9) for b, f in zip(times["base"], times["fn"]))
    return statistics.median(times["base"]), statistics.median(times["fn"]), ratio


def dense_variants(pb: PagedBatch, huge_pages: bool = False,
                   dtypes: tuple = (torch.float32, torch.float16, torch.bfloat16), page_size: int | None = None) -> dict:
    """Dense decode attention closures over pre-gathered contiguous K/V, named ``{sdpa,bmm}[-gqa]-{dtype}``.

    Per dtype of ``dtypes``: SDPA and bmm over K/V expanded to the query heads ``[H_q, L, D]``, and the
    GQA-grouped forms over ``[H_kv, L, D]`` (each KV head read once for its G query heads, which
    is the fastest dense path at long context here). ``huge_pages``: the gathered K/V lie on
    transparent huge pages (as louver's pool does when the benchmark gives it huge pages).
    ``page_size``: the pool's, where its pages are not exactly the table's (one request of a batch).
    """
    place = huge_copy if huge_pages else (lambda t: t)
    batch, h_q, _ = pb.q.shape
    groups = h_q // pb.k.shape[1]
    size = page_size or len(pb.k) // pb.page_table.numel()  # default: a pool of the table's pages alone
    out = {}
    for dtype in dtypes:
        ks, vs = [], []
        for b, n in enumerate(pb.seq_lens.tolist()):
            pos = torch.arange(n)
            slots = pb.page_table[b, pos // size] * size + pos % size
            ks.append(place(pb.k[slots].to(dtype).permute(1, 0, 2).repeat_interleave(groups, 0)))
            vs.append(place(pb.v[slots].to(dtype).permute(1, 0, 2).repeat_interleave(groups, 0)))
        q = pb.q.to(dtype)

        def sdpa(q=q, ks=ks, vs=vs):
            return [F.scaled_dot_product_attention(q[b, :, None], ks[b], vs[b], scale=pb.sigma) for b in range(batch)]

        def bmm(q=q, ks=ks, vs=vs, dtype=dtype):
            res = []
            for b in range(batch):
                p = torch.softmax(torch.bmm(q[b, :, None], ks[b].transpose(1, 2)).float() * pb.sigma, -1)
                res.append(torch.bmm(p.to(dtype), vs[b]))
            return res

        kg = [place(k[::groups].contiguous()) for k in ks]  # [H_kv, L, D]
        vg = [place(v[::groups].contiguous()) for v in vs]
        qg = q.view(batch, -1, groups, q.shape[-1])  # [B, H_kv, G, D]

        def sdpa_gqa(qg=qg, kg=kg, vg=vg):
            return [F.scaled_dot_product_attention(qg[b], kg[b], vg[b], scale=pb.sigma) for b in range(batch)]

        def bmm_gqa(qg=qg, kg=kg, vg=vg, dtype=dtype):
            res = []
            for b in range(batch):
                p = torch.softmax(torch.bmm(qg[b], kg[b].transpose(1, 2)).float() * pb.sigma, -1)
                res.append(torch.bmm(p.to(dtype), vg[b]))
            return res

        name = str(dtype).replace("torch.", "")
        out[f"sdpa-{name}"], out[f"bmm-{name}"] = sdpa, bmm
        out[f"sdpa-gqa-{name}"], out[f"bmm-gqa-{name}"] = sdpa_gqa, bmm_gqa
    return out


def recall_of_step(pb: PagedBatch, store: PageIndexStore, cfg: LouverConfig, stats) -> float:
    """Fraction of keys with exact fp64 score >= T that the step attended (must be 1.0).

    The attended set is recomputed with the reference semantics: a key is attended if its page is
    dense or its bound (page and token) reaches T for some head of the group; exactness means
    every key with q·k >= T passes the bound check.
    """
    from louver_sgl.index.numerics import keep_at_least

    size = cfg.page_size
    groups = pb.q.shape[1] // pb.k.shape[1]
    hit = total = 0
    for b, n in enumerate(pb.seq_lens.tolist()):
        _, indexed, _ = split_pages(n, cfg)
        pages = pb.page_table[b, indexed.start:indexed.stop]
        if len(pages) == 0:
            continue
        slots = (pages[:, None] * size + torch.arange(size)).reshape(-1)
        q = pb.q[b]
        s = torch.einsum("hd,nhd->hn", q.double(), pb.k[slots].double().repeat_interleave(groups, 1))
        t = stats.threshold[b]
        rows = q.view(1, store.num_kv_heads, groups, -1).expand(len(pages), -1, -1, -1).contiguous()
        bounds = store.page_bounds(rows, pages)
        tok = store.token_bounds(bounds, pages).reshape(-1, q.shape[0]).t()
        pbnd = bounds.page_bound.reshape(len(pages), -1).t().repeat_interleave(size, 1)
        passed = keep_at_least(torch.minimum(tok, pbnd), t[:, None])
        must = s >= t.double()[:, None]
        hit += int((must & passed).sum())
        total += int(must.sum())
    return 1.0 if total == 0 else hit / total


def bytes_read(stats, pb: PagedBatch, store: PageIndexStore, cfg: LouverConfig) -> float:
    """Bytes a step reads: codebooks of every indexed page, codes of kept pages, candidate keys,
    values of attended candidates, the dense part's K and V and the sample's K; a request that
    falls back to dense also reads all of its K and V."""
    h_kv, dim = store.num_kv_heads, store.head_dim
    elem = pb.k.element_size()
    fallback_tokens = int((stats.num_indexed * stats.dense_fallback).sum())
    per_page = store.nbytes() / store.num_pages
    code_bytes_page = store.code_bytes_per_page()
    pages = int(stats.num_pages.sum())
    dense_tokens = int((pb.seq_lens - stats.num_indexed).sum())
    sample = int(torch.clamp(stats.num_indexed, max=cfg.sample_size).sum())
    total = pages * (per_page - code_bytes_page) + int(stats.pages_read.sum()) * code_bytes_page
    total += int(stats.union_candidates.sum()) * dim * elem + int(stats.values_read.sum()) * dim * elem
    total += (dense_tokens + fallback_tokens) * h_kv * 2 * dim * elem + sample * h_kv * dim * elem
    return float(total)


def run_case(batches: dict[int, PagedBatch], repeats: int, indexes: dict, huge_pages: bool = False,
             policies: dict | None = None) -> dict:
    """One case: ``batches`` holds the same requests paged with each index's page size (the index
    pages are the KV pages); the dense side uses the first. ``huge_pages``: the dense side's K/V on
    huge pages too (set it when the batches' pools are)."""
    pb = next(iter(batches.values()))
    variants = dense_variants(pb, huge_pages)
    dense = {name: timeit(fn, repeats) for name, fn in variants.items()}
    best = min(dense, key=dense.get)
    kv_bytes = int(pb.seq_lens.sum()) * pb.k.shape[1] * 2 * pb.k.shape[2] * pb.k.element_size()
    result = {"dense_ms": dense, "best_dense": best, "best_dense_ms": dense[best],
              "dense_bytes": kv_bytes, "louver": []}
    for index_name, index_kw in indexes.items():
        for pol_name, pol_kw in (policies or POLICIES).items():
            pol_kw = dict(pol_kw)
            launch = pol_kw.pop("launch", None)
            cfg = LouverConfig(**index_kw, **pol_kw)
            pb = batches[cfg.page_size]
            store = PageIndexStore(cfg, len(pb.k) // cfg.page_size, pb.k.shape[1], pb.k.shape[2], pb.k.dtype)
            plan = plan_decode(pb.page_table, pb.seq_lens, cfg)
            start = time.perf_counter()
            store.build_pages(pb.k, plan.page_ids)
            build_s = time.perf_counter() - start
            # the backend plans once per forward pass for all layers: the step runs on the plan, whose
            # own cost is reported per batch (plan_ms)
            decode = LouverDecode(cfg, "cpu", launch=launch).plan(pb.page_table, pb.seq_lens)
            step = lambda: decode.run(pb.q, pb.k, pb.v, store, pb.sigma, stats=True)
            dense_ms, ms, paired = timeit_paired(variants[best], step, repeats)
            plan_ms = timeit(lambda: plan_decode(pb.page_table, pb.seq_lens, cfg), repeats)
            stats = step().stats
            n_idx = stats.num_indexed.sum().clamp(min=1)
            result["louver"].append({
                "index": index_name, "policy": pol_name, "ms": ms, "dense_ms": dense_ms, "speedup": dense_ms / ms,
                # the median of the rounds' own dense / louver ratios (each round times one of each)
                "speedup_paired": paired,
                "plan_ms": plan_ms,
                "candidate_fraction": float(stats.candidates.sum() / (n_idx * pb.q.shape[1])),
                "page_survival": float(stats.pages_read.sum() / stats.num_pages.sum().clamp(min=1)),
                "dense_fallbacks": int(stats.dense_fallback.sum()),
                "lowered_heads": int(stats.lowered.sum()),  # checks failed: the request attended again
                "union_candidate_fraction": float(stats.union_candidates.sum() / (n_idx * pb.k.shape[1])),
                "mass_bound_max": float(stats.mass_bound.max()),
                "bytes_read": bytes_read(stats, pb, store, cfg),
                "index_memory_vs_kv": store.bytes_per_token_head() / (2 * pb.k.shape[2] * pb.k.element_size()),
                "build_us_per_token": 1e6 * build_s / float(n_idx),
                "recall": recall_of_step(pb, store, cfg, stats),
            })
    return result


def plot(results: dict, path: Path) -> None:
    """Speedup vs context length, one panel per batch size: a color per policy, a line style per
    index; each point is the mean over the measured layers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({c["batch"] for c in results["cases"]})
    indexes = list(dict.fromkeys(r["index"] for c in results["cases"] for r in c["louver"]))
    styles = dict(zip(indexes, ("-o", "--s", "-.^", ":x")))
    palette = plt.get_cmap("tab20").colors
    colors = {name: palette[i % len(palette)] for i, name in enumerate(POLICIES)}
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5), sharey=True, squeeze=False)
    for ax, batch in zip(axes[0], batches):
        cases = [c for c in results["cases"] if c["batch"] == batch]
        lengths = sorted({c["length"] for c in cases})
        for pol in POLICIES:
            for idx in indexes:
                ys = [statistics.mean([r["speedup"] for c in cases if c["length"] == n for r in c["louver"]
                                       if r["policy"] == pol and r["index"] == idx] or [float("nan")])
                      for n in lengths]
                ax.plot(lengths, ys, styles[idx], color=colors[pol], label=f"{pol} ({idx})", lw=1.2, ms=4)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context tokens")
        ax.set_title(f"batch {batch}")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("speedup vs fastest dense path (same run)")
    axes[0][-1].legend(fontsize=6.5, ncol=1, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(f"louver decode step on CPU: SmolLM2-135M traces ({results['machine']['cpu']}, "
                 f"{results['machine']['threads']} threads, {results['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", nargs="+", default=["data/traces/bible_2048.pt", "data/traces/bible_8192.pt"])
    parser.add_argument("--layers", type=int, nargs="+", default=[9, 21])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--indexes", nargs="+", default=list(INDEXES), choices=list(INDEXES))
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--out", default="benchmarks/results/decode_cpu.json")
    parser.add_argument("--no-huge-pages", action="store_true",
                        help="keep K/V (both sides) on 4 KiB pages; the index store always asks for huge pages")
    parser.add_argument("--kv-dtype", default="float16", choices=["float16", "bfloat16", "float32"],
                        help="KV cache dtype of the paged batches (the traces hold fp16 keys and values)")
    parser.add_argument("--plot-only", action="store_true", help="redraw plot and table from --out")
    parser.add_argument("--markdown", action="store_true", help="with --plot-only: print the docs table")
    args = parser.parse_args()
    if args.plot_only:
        results = json.loads(Path(args.out).read_text())
        plot(results, Path(args.out).with_suffix(".png"))
        print(markdown_table(results)) if args.markdown else print_table(results)
        return
    torch.manual_seed(0)
    results = {"date": str(date.today()), "command": "python -m benchmarks.cpu.decode_cpu " + " ".join(
        f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items()),
        "machine": {"cpu": cpu_model_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                    "python": platform.python_version()}, "cases": []}
    jobs = [(t, layer, b) for t in args.traces for layer in args.layers for b in args.batches]
    for trace_path, layer, batch in tqdm(jobs, desc="cases"):
        trace = load_trace(trace_path)
        indexes = {k: INDEXES[k] for k in args.indexes}
        sizes = dict.fromkeys([64] + [LouverConfig(**kw).page_size for kw in indexes.values()])
        huge = not args.no_huge_pages
        kv_dtype = getattr(torch, args.kv_dtype)
        case = run_case({size: paged_batch(trace, layer, batch, size, kv_dtype, huge_pages=huge) for size in sizes},
                        args.repeats, indexes, huge, {k: POLICIES[k] for k in args.policies})
        case.update(trace=trace_path, length=int(trace["meta"]["length"]), layer=layer, batch=batch)
        results["cases"].append(case)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
    plot(results, Path(args.out).with_suffix(".png"))
    print_table(results)


def markdown_table(results: dict) -> str:
    """The docs table: one row per (length, batch, index, policy), means over the measured layers."""
    rows = {}
    for c in results["cases"]:
        for r in c["louver"]:
            key = (c["length"], c["batch"], r["index"], r["policy"])
            rows.setdefault(key, []).append((c, r))
    lines = ["| tokens | batch | index | policy | dense ms (best path) | louver ms | speedup | keys attended | "
             "pages read | bytes read vs dense | fallbacks | recall |", "|" + "---|" * 12]
    mean = statistics.mean
    for (length, batch, index, policy), group in rows.items():
        best = " / ".join(dict.fromkeys(c["best_dense"] for c, _ in group))
        lines.append(
            f"| {length} | {batch} | {index} | {policy} | {mean(r.get('dense_ms', c['best_dense_ms']) for c, r in group):.2f} ({best}) | "
            f"{mean(r['ms'] for _, r in group):.2f} | {mean(r['speedup'] for _, r in group):.2f} | "
            f"{mean(r['candidate_fraction'] for _, r in group):.3f} | {mean(r['page_survival'] for _, r in group):.2f} | "
            f"{mean(100 * r['bytes_read'] / c['dense_bytes'] for c, r in group):.0f}% | "
            f"{sum(r['dense_fallbacks'] for _, r in group)} | {min(r['recall'] for _, r in group):.3f} |")
    return "\n".join(lines)


def print_table(results: dict) -> None:
    print(f"{'len':>6} {'layer':>5} {'B':>2} {'dense':>12} {'ms':>7} | {'index':18} {'policy':15} {'ms':>7} "
          f"{'speedup':>7} {'paired':>6} {'cand':>6} {'pages':>6} {'bytes%':>6} {'fb':>2} {'recall':>6}")
    for c in results["cases"]:
        for r in c["louver"]:
            print(f"{c['length']:6d} {c['layer']:5d} {c['batch']:2d} {c['best_dense']:>12} {r.get('dense_ms', c['best_dense_ms']):7.2f} | "
                  f"{r['index']:18} {r['policy']:15} {r['ms']:7.2f} {r['speedup']:7.2f} "
                  f"{r.get('speedup_paired', float('nan')):6.2f} {r['candidate_fraction']:6.3f} "
                  f"{r['page_survival']:6.3f} {100 * r['bytes_read'] / c['dense_bytes']:6.1f} "
                  f"{r['dense_fallbacks']:2d} {r['recall']:6.3f}")


if __name__ == "__main__":
    main()
