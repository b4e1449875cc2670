"""Plots of the evaluation results (PNG), from the JSON files the evaluations write.

    python -m benchmarks.quality.eval_plots --results benchmarks/results --out docs/img

Each plot is drawn only when its result file exists: exactness (per-layer candidate and page
survival fractions, certified bound vs measured dropped mass), accuracy vs keys attended (louver
vs baselines), per-token KL, and the needle-in-a-haystack grid.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

STYLE = {"budget": ("tab:red", "o", "louver budget f"), "certified": ("tab:blue", "s", "louver certified ε"),
         "oracle_topk": ("black", "^", "oracle exact top-k"), "quest": ("tab:green", "D", "Quest-style pages"),
         "streaming": ("tab:orange", "v", "StreamingLLM sink+window")}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _subtitle(result: dict) -> str:
    m = result["machine"]
    return f"SmolLM2-135M, {m['cpu']}, torch threads = {m['threads']}, {m['date']}"


def plot_tradeoff(result: dict, out: Path) -> None:
    """Dropped softmax mass and output error vs fraction of keys attended, one line per method."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    groups: dict[str, list] = {}
    for name, row in result["methods"].items():
        groups.setdefault(name.partition("-")[0], []).append(row)
    for kind, rows in groups.items():
        color, marker, label = STYLE[kind]
        rows = sorted(rows, key=lambda r: r["attended_fraction"])
        x = [r["attended_fraction"] for r in rows]
        for ax, key in zip(axes, ("dropped_mass", "output_rel_error")):
            ax.plot(x, [max(r[key], 1e-9) for r in rows], marker=marker, color=color, label=label)
    for ax, title in zip(axes, ("mean dropped softmax mass", "mean relative output error |o − o_dense| / |o_dense|")):
        ax.set(xscale="log", yscale="log", xlabel="fraction of keys attended (incl. sink/recent/tail)", title=title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Accuracy vs keys attended on captured traces ({', '.join(result['traces'])})\n{_subtitle(result)}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_exactness(result: dict, arrays: dict[str, np.ndarray] | None, out: Path) -> None:
    """Per-layer candidate / page-survival fractions, and bound vs measured dropped mass."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (policy, per_layer) in enumerate(sorted(result["per_policy_layer"].items())):
        layers = sorted(per_layer, key=int)
        color = f"C{i}"
        axes[0].plot([int(k) for k in layers], [per_layer[k]["candidate_fraction"] for k in layers], "-o",
                     color=color, ms=3, label=f"{policy}: keys attended")
        axes[0].plot([int(k) for k in layers], [per_layer[k]["page_survival"] for k in layers], "--",
                     color=color, label=f"{policy}: pages surviving")
    axes[0].set(xlabel="layer", ylabel="fraction of indexed keys / pages", ylim=(0, 1.05),
                title="candidate and page-survival fractions (dense fallback = 1)")
    axes[0].legend(fontsize=7)
    if arrays is not None:
        sparse = arrays["bound"] > 0
        b, m = arrays["bound"][sparse], arrays["measured"][sparse]
        axes[1].hexbin(b, np.maximum(m, 1e-18), xscale="log", yscale="log", bins="log", gridsize=60, cmap="viridis", mincnt=1)
        lo = min(b.min(), m.min())
        axes[1].plot([lo, 1], [lo, 1], "r--", label="measured = bound")
        axes[1].set(xlabel="certified bound on dropped mass", ylabel="measured dropped mass (fp64)",
                    title=f"{len(b):,} sparse query-steps; measured ≤ bound in {int((m <= b).sum()):,}")
        axes[1].legend(fontsize=8)
    total = result["total"]
    fig.suptitle(f"Exactness: {total['query_steps']:,} query-steps, recall {total['recall']:.1f} "
                 f"({total['missed']} of {total['keys_at_or_above_T']:,} keys ≥ T missed); {_subtitle(result)}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_kl(result: dict, out: Path) -> None:
    """Mean and p90 per-token KL per policy (log scale)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 4.2))
    names = list(result["policies"])
    rows = [result["policies"][n] for n in names]
    x = np.arange(len(names))
    ax.bar(x - 0.2, [r["mean_kl"] for r in rows], 0.4, label="mean")
    ax.bar(x + 0.2, [r["p90_kl"] for r in rows], 0.4, label="p90")
    ax.set(yscale="log", ylabel="KL(dense ‖ policy) per token (nats)", xticks=x)
    labels = [f"{n}\n{r['attended_fraction']:.0%} keys" for n, r in zip(names, rows)]
    ax.set_xticklabels(labels, fontsize=8)
    ax.legend(fontsize=8)
    ax.set_title(f"Next-token KL from dense, held-out essays; {_subtitle(result)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_niah(result: dict, out: Path) -> None:
    """Single-needle score grid (length x depth) per configuration that has cells."""
    plt = _plt()
    configs = [c for c, cells in result["cells"].items() if any(k.startswith("single-") for k in cells)]
    lengths, depths = sorted(result["grid"]["lengths"]), sorted(result["grid"]["depths"])
    fig, axes = plt.subplots(1, len(configs), figsize=(2.6 * len(configs) + 1, 3.2), squeeze=False)
    for ax, config in zip(axes[0], configs):
        cells = result["cells"][config]
        grid = np.full((len(lengths), len(depths)), np.nan)
        for i, n in enumerate(lengths):
            for j, d in enumerate(depths):
                cell = cells.get(f"single-{n}-{d:g}")
                grid[i, j] = np.nan if cell is None else cell["score"]
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", origin="lower", aspect="auto")
        ax.set(xticks=range(len(depths)), xticklabels=[f"{d:.0%}" for d in depths], yticks=range(len(lengths)),
               yticklabels=lengths, xlabel="needle depth", title=config)
    axes[0][0].set_ylabel("context tokens")
    fig.suptitle(f"Needle in a haystack through the SGLang server (green = found); {_subtitle(result)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def exactness_arrays(result: dict, cache: Path) -> dict[str, np.ndarray] | None:
    """Concatenated per-query-step arrays of the certified prompts, from the evaluation cache."""
    from benchmarks.quality.eval_exactness import PromptSpec

    parts = [np.load(cache / f"{PromptSpec(**p).name}.npz") for p in result["prompts"]
             if p["policy"].startswith("certified")]
    if not parts or not all((cache / f"{PromptSpec(**p).name}.npz").exists() for p in result["prompts"]):
        return None
    return {k: np.concatenate([p[k] for p in parts]) for k in ("bound", "measured")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--cache", type=Path, default=Path("data/eval_cache"))
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    load = lambda name: json.loads((args.results / f"{name}.json").read_text())  # noqa: E731
    if (args.results / "eval_exactness.json").exists():
        result = load("eval_exactness")
        plot_exactness(result, exactness_arrays(result, args.cache / "exactness"), args.out / "eval_exactness.png")
    if (args.results / "eval_tradeoff.json").exists():
        plot_tradeoff(load("eval_tradeoff"), args.out / "eval_tradeoff.png")
    if (args.results / "eval_kl.json").exists():
        plot_kl(load("eval_kl"), args.out / "eval_kl.png")
    if (args.results / "eval_niah.json").exists():
        plot_niah(load("eval_niah"), args.out / "eval_niah.png")
    print(f"[plots] written to {args.out}")


if __name__ == "__main__":
    main()
