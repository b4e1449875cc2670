"""The docs table and plot of ``index_bytes.py``'s results (``benchmarks/results/index_bytes.json``).

    python -m benchmarks.studies.index_bytes_report --plot docs/img/index_bytes.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

POLICIES = ("budget0.05", "certified1e-2", "certified1e-3")


def _table(first: str, columns: list[str], rows: dict[str, list[str]]) -> str:
    """A markdown table: a header (``first``, then ``columns``) and one line per row label."""
    lines = [f"| {first} | " + " | ".join(columns) + " |", "|" + "---|" * (1 + len(columns))]
    return "\n".join(lines + [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows.items()])


def markdown(rows: list[dict], traces: list[str]) -> str:
    designs = list(dict.fromkeys(r["design"] for r in rows))
    cell = {(r["design"], r["trace"], r["policy"]): r for r in rows}
    keys = [(t, p) for t in traces for p in POLICIES]
    table = {}
    for d in designs:
        shipped = " (shipped)" if any(r["shipped"] for r in rows if r["design"] == d) else ""
        vals = [cell.get((d, t, p)) for t, p in keys]
        table[f"`{d}`{shipped}"] = [f"{v['bytes_fraction']:.3f} ({v['kept_over_oracle']:.2f}x)" if v else "-" for v in vals]
    return _table("design", [f"{t} {p}" for t, p in keys], table)


def parts_markdown(rows: list[dict], traces: list[str], policy: str = "budget0.05") -> str:
    """Where each design's bytes go under ``policy``: the mean over ``traces`` of each part."""
    from benchmarks.studies.index_bytes import PARTS

    designs = list(dict.fromkeys(r["design"] for r in rows if "bytes_by_part" in r))
    table = {}
    for d in designs:
        picked = [r for r in rows if r["design"] == d and r["policy"] == policy and r["trace"] in traces]
        mean = {k: sum(r["bytes_by_part"][k] for r in picked) / len(picked) for k in PARTS}
        table[f"`{d}`"] = [f"{mean[k]:.3f}" for k in PARTS] + [f"{sum(mean.values()):.3f}"]
    return _table(f"design ({policy})", [*PARTS, "total"], table)


def sectors_markdown(rows: list[dict], traces: list[str]) -> str:
    """The designs that read planes or tiers: bytes per token against bytes in whole 32-byte
    sectors (``bytes_fraction_sectors``), per trace and policy."""
    designs = [d for d in dict.fromkeys(r["design"] for r in rows) if d.startswith(("split", "alloc"))]
    cell = {(r["design"], r["trace"], r["policy"]): r for r in rows}
    keys = [(t, p) for t in traces for p in POLICIES]
    table = {f"`{d}`": [f"{v['bytes_fraction']:.3f} → {v['bytes_fraction_sectors']:.3f}"
                        if v and "bytes_fraction_sectors" in v else "-"
                        for v in (cell.get((d, t, p)) for t, p in keys)] for d in designs}
    return _table("design", [f"{t} {p}" for t, p in keys], table)


def past_first_markdown(rows: list[dict], traces: list[str], policy: str = "budget0.05") -> str:
    """Under ``policy``, per trace: the share of tokens (union of the group) that read past each
    plane or tier design's first one, and of 16-token blocks holding any."""
    designs = list(dict.fromkeys(r["design"] for r in rows if r.get("past_first_tokens") is not None))
    cell = {(r["design"], r["trace"]): r for r in rows if r["policy"] == policy}
    table = {f"`{d}`": [f"{v['past_first_tokens']:.2f} / {v['past_first_blocks16']:.2f}" if v else "-"
                        for v in (cell.get((d, t)) for t in traces)] for d in designs}
    return _table(f"design ({policy})", [f"{t} tokens / 16-token blocks" for t in traces], table)


def plot(rows: list[dict], traces: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    designs = [d for d in dict.fromkeys(r["design"] for r in rows) if not d.startswith("lowrank")]
    fig, axes = plt.subplots(1, len(POLICIES), figsize=(5 * len(POLICIES), 4), sharey=True)
    colors = plt.get_cmap("tab20")
    for ax, policy in zip(axes, POLICIES):
        for i, d in enumerate(designs):
            xs = [r["kept_over_oracle"] for r in rows if r["design"] == d and r["policy"] == policy and r["trace"] in traces]
            ys = [r["bytes_fraction"] for r in rows if r["design"] == d and r["policy"] == policy and r["trace"] in traces]
            marker = {"split": "*", "alloc": "D"}.get(d[:5], "o") if i < 20 else {"split": "P", "alloc": "X"}.get(d[:5], "s")
            ax.scatter(xs, ys, label=d, color=colors(i % 20), marker=marker, s=60)
        ax.set_title(policy)
        ax.set_xlabel("union candidates / oracle's")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("bytes per step / dense bf16 K+V")
    axes[-1].legend(fontsize=6, ncol=2)
    fig.suptitle("Index designs on " + ", ".join(traces) + " (low-rank off the chart: 6-11x the oracle)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="benchmarks/results/index_bytes.json")
    parser.add_argument("--traces", nargs="+", default=["bible_32768", "paul_graham_32768"])
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    rows = json.loads(Path(args.results).read_text())["rows"]
    print(markdown(rows, args.traces))
    print()
    print(parts_markdown(rows, args.traces))
    print()
    print(sectors_markdown(rows, args.traces))
    print()
    print(past_first_markdown(rows, args.traces))
    if args.plot:
        plot(rows, args.traces, Path(args.plot))


if __name__ == "__main__":
    main()
