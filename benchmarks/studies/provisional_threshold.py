"""How good is a provisional certified threshold? Pass rate of the one-pass check and the
candidates it keeps, against the histogram rule's certified T, on captured traces.

One-pass certified rule (docs/design-notes.md, "Certified in one pass"): the filter gates at a
provisional T_p and sums the bound of the mass it drops, D(T_p); if D(T_p)·(1 + rounding) fits
eps·Z_lb the step is certified at T_p, else the request runs the histogram rule (a second pass).
Provisional levels compared, per query head:

* ``safe``: ref + ln(eps·Z_lb / ((1 + rounding)·n_indexed)) / σ — every dropped unit is below it,
  so D(T_p) < n_indexed·exp(σ(T_p − ref)) fits: the check always passes;
* ``sample-c``: from the token bounds u_j of the step's evenly spaced sample (M of the n indexed
  keys), the highest u_j at which the sample's estimate of the dropped mass,
  (n/M)·Σ_{u_i < u_j} exp(σ(u_i − ref)), stays within c·eps·Z_lb; floored at ``safe``;
* ``sample-scores-c``: the same from the sample's exact scores (which the exact part has already);
* ``previous - d``: the previous decode step's certified T minus d/σ (the trace's queries are
  consecutive positions), floored at ``safe``;
* ``...-zatt`` (checked against Z_att, the a-posteriori rule's denominator: Z_dense plus the exact
  mass of the keys the head keeps at T_p, a lower bound of Z at least Z_lb): ``safe-est-s``, the
  safe level with Z_est = max(Z_lb, s·(Z_dense + (n/M)·Z_sample)) in place of Z_lb (the
  a-posteriori rule's estimate), and ``sample-scores-est-c``, the sample-scores level against
  c·eps·Z_est; both floored at ``safe``, and ``att-est-s-c``: the highest sample score at which
  the sample's estimate of the dropped mass fits c·eps times its estimate of the check's own
  denominator, Z_dense + (n/M)·Σ of the sample's masses at or above the level (what the head
  would attend there), floored at ``safe-est-s`` (never below the shipped level at that share).
  A failing check takes the histogram rule, as above.

For each rule: the fraction of (query, head) checks that pass, and the mean ratio of indexed
candidates kept to those the histogram rule keeps (passing checks; a failing one keeps the
histogram rule's set at the cost of a second pass); with ``--union``, also the GQA union of the
group's candidates (the K rows a step scores) and the share of (query, KV group) checks where
some head of the group fails (the compiled step then attends that group again).

    python -m benchmarks.studies.provisional_threshold --traces data/traces/bible_8192.pt data/traces/bible_32768.pt \\
        --out benchmarks/results/provisional_threshold.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from louver_sgl import LouverConfig, PageIndexStore
from louver_eval.data.paged import load_trace
from louver_sgl.decode import threshold as th
from louver_sgl.decode.plan import _sample_positions, split_pages
from benchmarks.record import write_result

MARGINS = (0.0, 0.5, 1.0, 2.0, 4.0)
SAMPLE_SHARES = (0.05, 0.1, 0.25, 0.5)
EST_SHARES = (1.0, 3.0, 4.0)  # the a-posteriori rule's estimate_share values (4: the AMD profiles')
ATT_EST_SHARES = (3.0, 4.0)  # att-est floors (of EST_SHARES): the shipped level at the default share and the profiles' 4
ATT_SHARES = (0.1, 0.25, 0.5)


def head_inputs(keys: torch.Tensor, q: torch.Tensor, store: PageIndexStore, config: LouverConfig, sigma: float):
    """Per query head of one query over ``keys`` [n, H_kv, D]: page bounds [NP, H], clamped token
    bounds [NP, P, H], ref [H], Z_lb [H] (the reference step's definitions), the sample's exact
    scores [M, H], Z_dense and Z_sample [H] (Z_lb's two parts) and the indexed keys' exact scores
    [NP, P, H]."""
    n, h_kv, _ = keys.shape
    size = config.page_size
    groups = q.shape[0] // h_kv
    sink, indexed, recent = split_pages(n, config)
    scores = torch.einsum("hd,lhd->hl", q.float(), keys.float().repeat_interleave(groups, 1))
    known = torch.ones(n, dtype=torch.bool)
    known[indexed.start * size: indexed.stop * size] = False
    idx_pos = torch.arange(indexed.start * size, indexed.stop * size)
    known[idx_pos[_sample_positions(len(idx_pos), config.sample_size)]] = True
    ref = torch.where(known, scores, -math.inf).amax(1)
    z_lb = torch.where(known, torch.exp(th.log_mass(scores, ref[:, None], sigma)), 0.0).sum(1)
    dense = torch.ones(n, dtype=torch.bool)
    dense[idx_pos] = False
    z_dense = torch.where(dense, torch.exp(th.log_mass(scores, ref[:, None], sigma)), 0.0).sum(1)
    page_ids = torch.arange(indexed.start, indexed.stop)
    rows = q.float().view(1, h_kv, groups, -1).expand(len(page_ids), -1, -1, -1).contiguous()
    bounds = store.page_bounds(rows, page_ids)
    tok = store.token_bounds(bounds, page_ids)
    pb = bounds.page_bound.reshape(len(page_ids), -1)
    tb = torch.minimum(tok.reshape(len(page_ids), size, -1), pb[:, None, :])
    sample_scores = scores[:, idx_pos[_sample_positions(len(idx_pos), config.sample_size)]].t()  # [M, H]
    exact = scores[:, idx_pos].t().reshape(len(page_ids), size, -1)
    return pb, tb, ref, z_lb, sample_scores, z_dense, z_lb - z_dense, exact


def kept_mask(pb, tb, t):
    """[NP, P, H] bool: the indexed tokens each head keeps at per-head thresholds t [H] (its page
    reaches t and so does its token bound)."""
    return ~(pb < t)[:, None, :] & ~(tb < t)


def dropped_and_kept(pb, tb, ref, t, sigma):
    """(D(T) [H] fp64, indexed candidates kept [H]) at per-head thresholds t [H]."""
    size = tb.shape[1]
    skip = pb < t
    x_page = th.log_mass(pb, ref, sigma)
    x_tok = th.log_mass(tb, ref, sigma)
    drop_tok = ~skip[:, None, :] & (tb < t)
    d = (size * torch.exp(x_page.clamp(max=700)) * skip).sum(0) + (torch.exp(x_tok.clamp(max=700)) * drop_tok).sum((0, 1))
    return d, kept_mask(pb, tb, t).sum((0, 1))


def sample_level(tb, ref, z_lb, sigma, eps_budget, share, sample_size, values=None):
    """The sample estimate's level [H] (docstring) from the token bounds tb [NP, P, H] (or from
    ``values`` [M, H], the sample's exact scores)."""
    u = tb.reshape(-1, tb.shape[-1])
    n = u.shape[0]
    pick = _sample_positions(n, sample_size)
    us = (u[pick] if values is None else values).double()  # [M, H]
    order = us.sort(dim=0).values
    mass = torch.exp(sigma * (order - ref.double())) * (n / len(pick))
    below = torch.cumsum(mass, 0) - mass  # estimated mass strictly below each sorted bound
    fits = below <= share * eps_budget * z_lb
    level = torch.where(fits, order, -math.inf).amax(0)
    return level.float()


def attended_level(ref, z_dense, sample_scores, n_indexed, sigma, eps_budget, share):
    """The ``att-est`` level [H]: the highest sample score s_j whose estimated dropped mass
    (n/M)·Σ_{s_i < s_j} e^{σ(s_i − ref)} fits share·eps·(Z_dense + (n/M)·Σ_{s_i ≥ s_j} e^{σ(s_i − ref)}),
    the check's denominator as the sample sees it; −inf where none fits."""
    order = sample_scores.double().sort(dim=0).values  # [M, H]
    mass = torch.exp(sigma * (order - ref.double())) * (n_indexed / order.shape[0])
    below = torch.cumsum(mass, 0) - mass
    above = mass.sum(0) - below
    fits = below <= share * eps_budget * (z_dense.double() + above)
    return torch.where(fits, order, -math.inf).amax(0).float()


def union_kept(pb, tb, t, groups: int):
    """GQA-union candidates [H_kv] at per-head thresholds t [H]: the rows some head of the group keeps."""
    keep = kept_mask(pb, tb, t)
    return keep.view(*keep.shape[:2], -1, groups).any(-1).sum((0, 1))


def attended_mass(pb, tb, exact, ref, t, sigma):
    """The exact mass [H] fp64 of the indexed keys each head keeps at t (its part of Z_att)."""
    keep = kept_mask(pb, tb, t)
    return (torch.exp(th.log_mass(exact, ref, sigma).double().clamp(max=700)) * keep).sum((0, 1))


def safe_level(ref, z_lb, n_indexed, sigma, eps_budget, rounding):
    return (ref.double() + torch.log(eps_budget * z_lb / ((1 + rounding) * n_indexed)) / sigma).float()


def measure(path: Path, eps: float, config: LouverConfig, union: bool = False) -> list[dict]:
    trace = load_trace(path)
    out = []
    for layer in sorted(trace["keys"]):
        keys = trace["keys"][layer]
        queries = trace["queries"][layer]
        n = int(trace["query_positions"][0]) + 1
        k = keys[:n]
        sigma = 1 / math.sqrt(k.shape[-1])
        store = PageIndexStore(config, n // config.page_size + 1, k.shape[1], k.shape[2], k.dtype)
        full = n // config.page_size
        store.build_pages(k[: full * config.page_size].view(full, config.page_size, *k.shape[1:]).reshape(-1, *k.shape[1:]),
                          torch.arange(full))
        eps_budget = eps * th.BUDGET_SAFETY
        prev_t = None
        for qi in range(queries.shape[0]):
            pb, tb, ref, z_lb, sample_scores, z_dense, z_sample, exact = head_inputs(k, queries[qi], store, config,
                                                                                      sigma)
            n_idx = pb.shape[0] * config.page_size
            page_req = torch.zeros(pb.shape[0], dtype=torch.long)
            t_c, _, _, _ = th.certified_choice(pb, tb, page_req, ref[None], z_lb[None], sigma, eps_budget,
                                               th.HIST_ROUNDING)
            t_c = t_c[0]
            _, kept_c = dropped_and_kept(pb, tb, ref, t_c, sigma)
            safe = safe_level(ref, z_lb, n_idx, sigma, eps_budget, th.HIST_ROUNDING)
            rules = {"safe": safe}
            for share in SAMPLE_SHARES:
                est = sample_level(tb, ref, z_lb, sigma, eps_budget, share, config.sample_size)
                rules[f"sample-{share:g}"] = torch.maximum(est, safe)
                est = sample_level(tb, ref, z_lb, sigma, eps_budget, share, config.sample_size, sample_scores)
                rules[f"sample-scores-{share:g}"] = torch.maximum(est, safe)
            if prev_t is not None:
                for d in MARGINS:
                    rules[f"previous-{d:g}"] = torch.maximum(prev_t - d / sigma, safe)
            m = sample_scores.shape[0]
            for est_share in EST_SHARES:
                z_est = torch.maximum(z_lb, est_share * (z_dense + z_sample * n_idx / m))
                rules[f"safe-est-{est_share:g}-zatt"] = torch.maximum(
                    safe_level(ref, z_est, n_idx, sigma, eps_budget, th.HIST_ROUNDING), safe)
                for share in SAMPLE_SHARES:
                    est = sample_level(tb, ref, z_est, sigma, eps_budget, share, config.sample_size, sample_scores)
                    rules[f"sample-scores-est{est_share:g}-{share:g}-zatt"] = torch.maximum(est, safe)
            for est_share in ATT_EST_SHARES:
                floor = rules[f"safe-est-{est_share:g}-zatt"]
                for share in ATT_SHARES:
                    level = attended_level(ref, z_dense, sample_scores, n_idx, sigma, eps_budget, share)
                    rules[f"att-est{est_share:g}-{share:g}-zatt"] = torch.maximum(level, floor)
            groups = queries.shape[1] // k.shape[1]
            union_c = union_kept(pb, tb, t_c, groups).tolist() if union else None
            for rule, t_p in rules.items():
                d_p, kept_p = dropped_and_kept(pb, tb, ref, t_p, sigma)
                z = z_lb
                if rule.endswith("-zatt"):
                    z = torch.maximum(z_lb, z_dense + attended_mass(pb, tb, exact, ref, t_p, sigma))
                ok = d_p * (1 + th.HIST_ROUNDING) <= eps_budget * z
                row = dict(trace=path.name, layer=layer, query=qi, rule=rule, eps=eps,
                           passed=ok.tolist(), kept=kept_p.tolist(), kept_histogram=kept_c.tolist(),
                           indexed=n_idx)
                if union:
                    row["union"] = union_kept(pb, tb, t_p, groups).tolist()
                    row["union_histogram"] = union_c
                    row["group_passed"] = ok.view(-1, groups).all(1).tolist()
                out.append(row)
            prev_t = t_c
    return out


def summarize(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["trace"], r["eps"], r["rule"]), []).append(r)
    table = []
    for (trace, eps, rule), rs in groups.items():
        passed = [p for r in rs for p in r["passed"]]
        ratios = [kp / max(kc, 1) for r in rs for p, kp, kc in zip(r["passed"], r["kept"], r["kept_histogram"]) if p]
        frac_c = sum(sum(r["kept_histogram"]) for r in rs) / sum(r["indexed"] * len(r["kept"]) for r in rs)
        frac_p = sum(sum(kp if p else kc for p, kp, kc in zip(r["passed"], r["kept"], r["kept_histogram"]))
                     for r in rs) / sum(r["indexed"] * len(r["kept"]) for r in rs)
        row = dict(trace=trace, eps=eps, rule=rule, checks=len(passed), pass_rate=sum(passed) / len(passed),
                   mean_kept_ratio_when_passed=sum(ratios) / max(len(ratios), 1),
                   candidate_fraction_histogram=frac_c, candidate_fraction_one_pass=frac_p)
        if "union" in rs[0]:
            # a failing group keeps its union at the level it was checked at (the step attends it
            # again at a lower one: counted as a failure, not in the union)
            cells = sum(r["indexed"] * len(r["union"]) for r in rs)
            groups_passed = [p for r in rs for p in r["group_passed"]]
            row.update(union_fraction=sum(sum(r["union"]) for r in rs) / cells,
                       union_fraction_histogram=sum(sum(r["union_histogram"]) for r in rs) / cells,
                       group_pass_rate=sum(groups_passed) / len(groups_passed))
        table.append(row)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", nargs="+", required=True)
    parser.add_argument("--eps", type=float, nargs="+", default=[1e-3, 1e-2])
    parser.add_argument("--grid-bits", type=int, default=4)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--union", action="store_true",
                        help="also the GQA union of each group's candidates and per-group pass rates")
    parser.add_argument("--out", default="benchmarks/results/provisional_threshold.json")
    args = parser.parse_args()
    config = LouverConfig(page_size=args.page_size, grid_bits=args.grid_bits, policy="certified")
    rows = [r for path in args.traces for eps in args.eps for r in measure(Path(path), eps, config, args.union)]
    table = summarize(rows)
    for row in table:
        print(json.dumps(row))
    write_result(args.out, {"summary": table})


if __name__ == "__main__":
    main()
