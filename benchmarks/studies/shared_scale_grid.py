"""How many keys a grid with one scale per (layer, KV head, channel) keeps, against per-page grids.

The compiled CPU step quantises its int8 query weights once per page, because every page has its
own grid (its own per-channel range): about an eighth of a 32K step (docs/benchmarks.md, the
ablation bullet of "The scan alone at 32K"). With one range shared by every page of a layer and
KV head the weights would be quantised once per step. This study measures, in fp64 with the same
bound as the index (cell centre plus the page's largest per-channel deviation), the keys each grid
keeps at T = the exact 95 % quantile of a head's scores, as a multiple of the 5 % the exact oracle
keeps (per head, not the GQA union):

* ``page``: today's per-page grid (range of the page's own keys);
* ``shared``: one range per (layer, KV head, channel), that of the whole context's keys;
* ``calibrated``: one range taken from the first ``--calibration`` tokens and clamped, as a range
  fixed at the first prefill would be (later keys outside it make large cell deviations).

    python -m benchmarks.studies.shared_scale_grid --trace data/traces/bible_32768.pt \\
        --out benchmarks/results/shared_scale_grid.json
"""

from __future__ import annotations

import argparse
import json
from datetime import date

import torch

from louver_eval.data.paged import load_trace


def grid_bounds(pages: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int):
    """Cell centres ``[pages, P, H, D]`` and per-page deviations ``[pages, H, D]`` of ``pages``
    ``[pages, P, H, D]`` coded on the grid of ``lo``/``hi`` ``[pages, H, D]`` (codes clamped)."""
    levels = 1 << bits
    step = (hi - lo) / levels
    step = torch.where(step > 0, step, torch.ones_like(step))
    code = torch.floor((pages - lo.unsqueeze(1)) / step.unsqueeze(1)).clamp(0, levels - 1)
    centre = lo.unsqueeze(1) + (code + 0.5) * step.unsqueeze(1)
    return centre, (pages - centre).abs().amax(1)


def kept_over_oracle(keys: torch.Tensor, queries: torch.Tensor, page_size: int, bits: int, calibration: int,
                     keep: float = 0.05) -> dict[str, float]:
    """Mean over queries and heads of (keys whose bound reaches T) / (keep · keys), per grid.
    keys ``[N, H, D]``, queries ``[nq, H_q, D]`` (fp64)."""
    n = keys.shape[0] // page_size * page_size
    keys = keys[:n]
    heads, groups = keys.shape[1], queries.shape[1] // keys.shape[1]
    pages = keys.view(n // page_size, page_size, heads, keys.shape[2])
    page_lo, page_hi = pages.amin(1), pages.amax(1)
    head = calibration if calibration > 0 else n
    grids = {"page": (page_lo, page_hi),
             "shared": (keys.amin(0).expand_as(page_lo), keys.amax(0).expand_as(page_hi)),
             "calibrated": (keys[:head].amin(0).expand_as(page_lo), keys[:head].amax(0).expand_as(page_hi))}
    bounds = {name: grid_bounds(pages, lo, hi, bits) for name, (lo, hi) in grids.items()}
    ratios = {name: [] for name in grids}
    for qi in range(queries.shape[0]):
        for h in range(heads):
            for g in range(groups):
                q = queries[qi, h * groups + g]
                t = torch.quantile(keys[:, h] @ q, 1.0 - keep)
                for name, (centre, dev) in bounds.items():
                    ub = centre[:, :, h] @ q + (dev[:, h] @ q.abs()).unsqueeze(1)
                    ratios[name].append(float((ub >= t).double().mean()) / keep)
    return {name: sum(v) / len(v) for name, v in ratios.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default="data/traces/bible_32768.pt")
    parser.add_argument("--layers", type=int, nargs="+", default=[9, 15, 21])
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--bits", type=int, default=8)
    parser.add_argument("--calibration", type=int, default=4096, help="tokens the calibrated range is taken from")
    parser.add_argument("--out", default="benchmarks/results/shared_scale_grid.json")
    args = parser.parse_args()
    trace = load_trace(args.trace)
    rows = []
    for layer in args.layers:
        keys, queries = trace["keys"][layer].double(), trace["queries"][layer].double()
        kept = kept_over_oracle(keys, queries, args.page_size, args.bits, args.calibration)
        rows.append({"trace": args.trace, "layer": layer, "page_size": args.page_size, "bits": args.bits,
                     "calibration_tokens": args.calibration,
                     **{f"kept_over_oracle_{name}": round(v, 4) for name, v in kept.items()}})
        print(json.dumps(rows[-1]), flush=True)
    command = ("python -m benchmarks.studies.shared_scale_grid --trace " + args.trace + " --layers "
               + " ".join(map(str, args.layers)) + f" --page-size {args.page_size} --bits {args.bits}"
               + f" --calibration {args.calibration} --out {args.out}")
    with open(args.out, "w") as f:
        json.dump({"date": date.today().isoformat(), "command": command, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
