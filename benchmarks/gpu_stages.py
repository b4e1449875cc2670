"""Where the GPU step's time goes: every stage of every implementation timed alone beside the
whole step, with its bytes and its floor at FlashInfer's measured bandwidth, and the
speed-of-light rows (``gpu_sol``) in the same run. ``gpu_bench --stages`` prints this table
first, so that each lent minute says where the time goes; its CPU dry run is
``tests/test_gpu_bench_dry_run.py``.

Also the native check that the certified Triton steps' bounds agree across kernels compiled with
different warps (``check_bounds_across_warps``): the attended set at the step's own T against the
int8 bound specification.
"""

from __future__ import annotations

import math

import torch

from benchmarks import gpu_sol
from benchmarks.gpu_bench import (
    DEVICE, PagedCase, empty_store, flashinfer_method, graph_time, log, louver_bytes, louver_method,
)
from louver_kernels.triton import tiled_decode
from louver_kernels.triton.launch import TritonLaunch
from louver_sgl import LouverConfig
from louver_sgl.decode import LouverDecode

STAGE_CASES = (("llama3_8b", 131072, 1), ("llama3_8b", 131072, 8))
SOL_FRACTIONS = (0.05, 0.125, 0.25)
STAGE_POLICIES = (("budget0.05", dict(policy="budget", budget=0.05)), ("cert1e-3", dict(policy="certified", eps=1e-3)))


def stage_bytes(name: str, case: PagedCase, config: LouverConfig, stats, impl: str) -> float:
    """Bytes a stage must move (each input once): codes and page codebooks for the passes over
    the index, K rows of the union and V rows read for the attention, list entries, split states."""
    h_kv, dim = case.k_cache.shape[1:]
    elem = case.k_cache.element_size()
    row = dim * elem
    indexed = float(stats.num_indexed.sum())
    pages = indexed / case.page_size * h_kv
    dense_tokens = case.batch * case.context - indexed
    index = float(stats.pages_read.sum()) * case.page_size * dim * config.grid_bits / 8 + pages * 3 * row
    union, values = float(stats.union_candidates.sum()), float(stats.values_read.sum())
    entry = 4 + (triton_group(case) if config.threshold.certified else 0)
    attention = union * row + values * row + dense_tokens * h_kv * 2 * row
    if name == "exact_part":
        return (dense_tokens * h_kv + case.batch * h_kv * config.sample_size) * row
    if name in ("certified_hist", "filter"):
        return index + (union * entry if impl != "triton" else 0)
    if name == "attend":
        return attention + (index if impl == "triton" else union * entry)
    if name == "compact":
        return 2 * union * entry
    if name == "merge":
        return float(case.batch * case.q.shape[1] * (case.page_table.shape[1] + 2) * 4)  # split states (rough)
    return 0.0


def triton_group(case: PagedCase) -> int:
    return 1 << (case.q.shape[1] // case.k_cache.shape[1] - 1).bit_length()


def stage_rows(case: PagedCase, shape: str, impls, launches: dict, fi_gbps: float | None, bits: int) -> list[dict]:
    """Every stage of every implementation and policy on one case, then the whole step."""
    rows = []
    for impl in impls:
        for label, policy in STAGE_POLICIES:
            config = LouverConfig(page_size=case.page_size, grid_bits=bits, **policy)
            try:
                step, out, holder, store, _ = louver_method(case, config, launches.get(impl, TritonLaunch()), impl)
            except ValueError as exc:  # a policy the implementation refuses by name
                log(f"stages {impl} {label}: refused ({exc})")
                continue
            whole = graph_time(step)
            step(with_stats=True)
            stats, decode = holder["stats"], holder["decode"]
            base = dict(shape=shape, context=case.context, batch=case.batch, impl=impl, policy=label)
            moved = louver_bytes(case, config, stats, store)
            stages = decode.impl.stages(case.q, case.k_cache, case.v_cache, decode.current_plan.workspace, store,
                                        case.sigma, out, None)
            for name, fn in stages:
                ms = graph_time(fn)
                nbytes = stage_bytes(name, case, config, stats, impl)
                rows.append(dict(base, stage=name, ms=ms, bytes=nbytes, gbps=nbytes / ms / 1e6 if nbytes else None,
                                 floor_ms=nbytes / fi_gbps / 1e6 if fi_gbps and nbytes else None))
            rows.append(dict(base, stage="step", ms=whole, bytes=moved, gbps=moved / whole / 1e6,
                             floor_ms=moved / fi_gbps / 1e6 if fi_gbps else None,
                             stages_sum_ms=sum(r["ms"] for r in rows[-len(stages):]),
                             union_fraction=float(stats.union_candidates.sum() / (stats.num_indexed.sum() * case.k_cache.shape[1]))))
            del store
    return rows


def sol_rows(case: PagedCase, shape: str, fi_gbps: float | None, bits: int, tile_pages: int = 4) -> list[dict]:
    """The code scan's time and bandwidth, and SGLang's Triton decode against ``triton_tiled``'s
    attention over the same head-folded lists of a fraction of the tokens."""
    rows = []
    base = dict(shape=shape, context=case.context, batch=case.batch)
    config = LouverConfig(page_size=case.page_size, grid_bits=bits, policy="budget", budget=0.05)
    store = empty_store(case, config)
    store.build_pages(case.k_cache, torch.arange(store.num_pages, device=DEVICE))
    h_kv, dim = case.k_cache.shape[1:]
    n_tiles = math.ceil(case.page_table.shape[1] / tile_pages)
    weights = torch.randint(-127, 128, (16, dim), device=DEVICE).to(torch.float16)
    out = torch.empty(case.batch, h_kv, n_tiles, dtype=torch.float32, device=DEVICE)
    codes = store.tensors["codes"]
    ms = graph_time(lambda: gpu_sol.code_scan(case.page_table, case.seq_lens, codes, weights, out, case.page_size,
                                              bits, tile_pages))
    nbytes = case.batch * case.context * h_kv * dim * bits / 8
    rows.append(dict(base, stage="sol_code_scan", ms=ms, bytes=nbytes, gbps=nbytes / ms / 1e6,
                     floor_ms=nbytes / fi_gbps / 1e6 if fi_gbps else None))
    for fraction in SOL_FRACTIONS:
        rows += _list_attention_rows(case, base, fraction, fi_gbps)
    return rows


def _list_attention_rows(case: PagedCase, base: dict, fraction: float, fi_gbps) -> list[dict]:
    h_q, h_kv, dim = case.q.shape[1], case.k_cache.shape[1], case.k_cache.shape[2]
    groups = h_q // h_kv
    cap = case.page_table.shape[1] * case.page_size
    (indptr, indices), lists = gpu_sol.folded_lists(case.page_table, case.seq_lens, h_kv, case.page_size, fraction, cap)
    rows_read = float(indices.numel())
    nbytes = rows_read * dim * case.k_cache.element_size() * 2 + rows_read * 4
    rows = []
    try:
        from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
        q_fold = case.q.reshape(case.batch * h_kv, groups, dim)
        k_fold = case.k_cache.reshape(-1, 1, dim)
        v_fold = case.v_cache.reshape(-1, 1, dim)
        out = torch.empty_like(q_fold)
        for splits in (8, 32, 64):
            logits = torch.empty(case.batch * h_kv, groups, splits, dim, dtype=torch.float32, device=DEVICE)
            lse = torch.empty(case.batch * h_kv, groups, splits, dtype=torch.float32, device=DEVICE)
            n_splits = torch.full((case.batch * h_kv,), splits, dtype=torch.int32, device=DEVICE)
            ms = graph_time(lambda: decode_attention_fwd(q_fold, k_fold, v_fold, out, indptr, indices, logits, lse,
                                                         n_splits, splits, case.sigma, 1.0, 1.0))
            rows.append(dict(base, stage=f"sol_sglang_lists_{fraction:g}_s{splits}", ms=ms, bytes=nbytes,
                             gbps=nbytes / ms / 1e6, floor_ms=nbytes / fi_gbps / 1e6 if fi_gbps else None))
    except Exception as exc:  # SGLang's kernel is carried onto the GPU machine; absent here it is skipped
        log(f"[sol] SGLang's Triton decode unavailable: {type(exc).__name__}: {str(exc)[:160]}")
    rows.append(_tiled_lists_row(case, base, fraction, lists, nbytes, fi_gbps))
    return rows


def _tiled_lists_row(case: PagedCase, base: dict, fraction: float, lists: dict, nbytes: float, fi_gbps) -> dict:
    """``triton_tiled``'s attention alone over the same lists (no gate, every head every row)."""
    from louver_kernels.triton import grid_decode as kern

    h_q, h_kv, dim = case.q.shape[1], case.k_cache.shape[1], case.k_cache.shape[2]
    launch = TritonLaunch()
    bg = kern.block_g(h_q // h_kv, launch)
    state = (case.batch, h_kv, launch.list_splits, bg)
    f32 = dict(dtype=torch.float32, device=DEVICE)
    m, l, o = torch.empty(state, **f32), torch.empty(state, **f32), torch.empty(*state, dim, **f32)
    z_own = torch.empty(state, dtype=torch.float64, device=DEVICE)
    counts = torch.empty(*state[:3], 3, bg, dtype=torch.int32, device=DEVICE)
    gated = torch.empty(state, **f32)
    ref = torch.zeros(case.batch, h_q, **f32)
    t = torch.full((case.batch, h_q), -math.inf, **f32)
    flags = torch.zeros(case.batch, dtype=torch.int32, device=DEVICE)
    layout = dict(P=case.page_size, SINK=0, RECENT=0)
    lists = dict(lists, total=lists["total"].reshape(-1))
    lens = torch.full_like(case.seq_lens, case.context // case.page_size * case.page_size)
    ms = graph_time(lambda: tiled_decode.tiled_attend(
        case.q, case.k_cache, case.v_cache, case.page_table, lens, lists, t, ref, flags, None, m, l, o, z_own, counts,
        gated, case.sigma, layout, 0, False, 0.0, kern._kv_dtype(case.k_cache), launch))
    return dict(base, stage=f"sol_tiled_lists_{fraction:g}", ms=ms, bytes=nbytes, gbps=nbytes / ms / 1e6,
                floor_ms=nbytes / fi_gbps / 1e6 if fi_gbps else None)


def stage_table(layer, args, dtype, impls, launches: dict | None = None) -> list[dict]:
    """The stage rows and the speed-of-light rows of ``args.stage_cases`` (default
    ``STAGE_CASES``), with FlashInfer's time and bandwidth on each case; printed as a table."""
    rows = []
    for shape, context, batch in stage_cases(args):
        case = PagedCase(layer, shape, context, batch, args.page_size, dtype)
        fi_ms, fi_gbps = None, None
        try:
            fi_ms = graph_time(flashinfer_method(case, torch.empty_like(case.q)))
            fi_gbps = case.dense_bytes() / fi_ms / 1e6
        except Exception as exc:
            log(f"[stages] FlashInfer unavailable: {type(exc).__name__}: {str(exc)[:160]}")
        rows.append(dict(shape=shape, context=context, batch=batch, impl="flashinfer", policy="dense", stage="step",
                         ms=fi_ms, bytes=case.dense_bytes(), gbps=fi_gbps, floor_ms=fi_ms))
        rows += sol_rows(case, shape, fi_gbps, max(args.bits))
        rows += stage_rows(case, shape, impls, launches or {}, fi_gbps, max(args.bits))
        del case
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    print_stage_table(rows)
    return rows


def stage_cases(args) -> tuple:
    if getattr(args, "stage_cases", None):
        return tuple((s, int(c), int(b)) for s, c, b in (x.split(":") for x in args.stage_cases))
    return STAGE_CASES


def print_stage_table(rows: list[dict]) -> None:
    log("\nstage table: shape ctx B impl policy stage ms GB/s floor_ms(at FlashInfer's bandwidth)")
    for r in rows:
        fmt = lambda x, f: (f"{x:{f}}" if isinstance(x, (int, float)) else "-")  # noqa: E731
        log(f"  {r['shape']:<9} {r['context']:>6} {r['batch']:>2} {r.get('impl', ''):<13} {r.get('policy', ''):<10} "
            f"{r['stage']:<28} {fmt(r['ms'], '8.4f')} {fmt(r.get('gbps'), '7.0f')} {fmt(r.get('floor_ms'), '8.4f')}")


# ----------------------------------------------------------------------------- bounds across warps

WARP_LAUNCH = TritonLaunch(pages_per_split=8, hist_warps=8, attend_warps=2, filter_warps=8, exact_warps=2)


def check_bounds_across_warps(layer, page_size: int, dtype, tokens: int, impls=("triton", "triton_stream")) -> list[dict]:
    """Certified steps whose kernels run with different warps (histogram 8, attend 2, filter 8):
    recall at T, the true dropped mass within the bound, the bound below eps, and the attended
    set against the int8 bound specification at the step's own T (mismatches only within a
    relative 1e-5 of T, where two summation orders may differ). Raises ``AssertionError`` on any."""
    from louver_sgl.decode.reference_compiled import int8_token_bounds_reference

    rows = []
    for impl in impls:
        case = PagedCase(layer, "llama3_8b", tokens - 17, 2, page_size, dtype)
        config = LouverConfig(page_size=page_size, policy="certified", eps=1e-3)
        store = empty_store(case, config)
        store.build_pages(case.k_cache, torch.arange(store.num_pages, device=DEVICE))
        decode = LouverDecode(config, DEVICE, impl=impl, launch=WARP_LAUNCH).plan(case.page_table, case.seq_lens)
        result = decode.run(case.q, case.k_cache, case.v_cache, store, case.sigma, attended=True)
        stats = result.stats
        h_kv, groups = case.k_cache.shape[1], case.q.shape[1] // case.k_cache.shape[1]
        far, near, missed, over = 0, 0, 0, 0
        for b in range(case.batch):
            n_pages = case.context // page_size
            first, end = config.sink_pages, n_pages - config.recent_pages
            ids = case.page_table[b, first:end].long()
            rows_q = case.q[b].float().view(1, h_kv, groups, -1).expand(len(ids), -1, -1, -1).contiguous()
            bounds = store.page_bounds(rows_q, ids)
            tok = int8_token_bounds_reference(*bounds.terms, store.page_codes(ids), config.grid_bits)
            t = stats.threshold[b].view(h_kv, groups)
            spec = (bounds.page_bound >= t)[:, None] & (tok >= t)  # [pages, P, H_kv, G]
            spec = spec.permute(2, 3, 0, 1).reshape(h_kv * groups, -1)
            got = result.attended[b][:, first * page_size:end * page_size].to(spec.device)
            close = ((tok - t).abs() <= 1e-5 * (t.abs() + 1)).permute(2, 3, 0, 1).reshape(h_kv * groups, -1)
            differ = got != spec
            far += int((differ & ~close).sum())
            near += int((differ & close).sum())
            scores = torch.einsum("hd,lhd->hl", case.q[b].double(), case.contiguous_kv()[0][b].double()
                                  .repeat_interleave(groups, 0).transpose(0, 1))[:, :case.context]
            mask = result.attended[b].to(scores.device)[:, :case.context]
            missed += int(((scores >= stats.threshold[b].double()[:, None]) & ~mask).sum())
            dropped = (torch.softmax(case.sigma * scores, -1) * ~mask).sum(-1)
            over += int((dropped > stats.mass_bound[b].to(dropped.device)).sum())
        rows.append(dict(impl=impl, launch=WARP_LAUNCH.__dict__, spec_mismatch_far=far, spec_mismatch_near=near,
                         false_negatives=missed, dropped_over_bound=over,
                         max_bound=float(stats.mass_bound.max()), eps=config.eps))
        log("bounds across warps", rows[-1])
    bad = [r for r in rows if r["spec_mismatch_far"] or r["false_negatives"] or r["dropped_over_bound"]
           or not r["max_bound"] < r["eps"]]
    assert not bad, f"certified steps with other warps broke the bound specification: {bad}"
    return rows
