"""Markdown tables of the evaluation results, as pasted into docs/results.md.

    python -m benchmarks.quality.eval_tables --results benchmarks/results
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(header: list[str], rows: list[list]) -> str:
    return "\n".join([_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows)])


def exactness_tables(result: dict) -> str:
    """Totals per policy, the bound/measured distribution, and per-layer fractions."""
    policies = [[name, f"{r['query_steps']:,}", f"{r['keys_at_or_above_T']:,}", r["missed"], f"{r['recall']:.1f}",
                 f"{r['candidate_fraction']:.3f}", f"{r['page_survival']:.3f}",
                 f"{r['dense_fallback_steps']:,} / {r['steps']:,}", r["bound_violations"]]
                for name, r in sorted(result["per_policy"].items())]
    t = result["total"]
    policies.append(["**all**", f"{t['query_steps']:,}", f"{t['keys_at_or_above_T']:,}", t["missed"], f"{t['recall']:.1f}",
                     f"{t['candidate_fraction']:.3f}", f"{t['page_survival']:.3f}",
                     f"{t['dense_fallback_steps']:,} / {t['steps']:,}", t["bound_violations"]])
    first = _table(["policy", "query-steps", "keys ≥ T (fp64)", "missed", "recall", "keys attended (of indexed)",
                    "pages surviving", "dense-fallback (layer) steps", "measured > bound"], policies)
    mass = [[name, f"{m['sparse_query_steps']:,}", f"{m['measured_le_bound']:,} / {m['query_steps']:,}",
             *(f"{b:.2e} / {x:.2e}" for b, x in zip(m["bound"][1:], m["measured"][1:])),
             f"{m['measured_over_bound'][-1]:.3f}"]
            for name, m in sorted(result["mass"].items())]
    second = _table(["policy", "sparse query-steps", "measured ≤ bound", "median bound / measured",
                     "p90 bound / measured", "p99 bound / measured", "max bound / measured", "max measured/bound"], mass)
    layers = sorted(result["per_layer"], key=int)
    per_layer = [[k, *(f"{result['per_policy_layer'][p][k]['candidate_fraction']:.2f}"
                       for p in sorted(result["per_policy_layer"]))] for k in layers]
    third = _table(["layer", *(f"{p} keys attended" for p in sorted(result["per_policy_layer"]))], per_layer)
    return "\n\n".join([first, second, third])


def tradeoff_table(result: dict) -> str:
    rows = sorted(result["methods"].items(), key=lambda kv: (kv[0].partition("-")[0], kv[1]["attended_fraction"]))
    return _table(["method", "keys attended", "mean dropped mass", "max dropped mass", "mean rel. output error",
                   "worst-cell p99 rel. error", "measured ≤ bound"],
                  [[name, f"{r['attended_fraction']:.3f}", f"{r['dropped_mass']:.2e}", f"{r['max_dropped_mass']:.2e}",
                    f"{r['output_rel_error']:.2e}", f"{r['p99_output_rel_error']:.2e}",
                    f"{r['measured_le_bound']} / {r['query_heads']}" if "measured_le_bound" in r else "—"]
                   for name, r in rows])


def kl_table(result: dict) -> str:
    return _table(["policy", "keys attended", "tokens", "mean KL", "median KL", "p90 KL", "max KL", "top-1 agreement"],
                  [[name, f"{r['attended_fraction']:.3f}", r["tokens"], f"{r['mean_kl']:.2e}", f"{r['median_kl']:.2e}",
                    f"{r['p90_kl']:.2e}", f"{r['max_kl']:.2e}", f"{r['top1_agreement']:.3f}"]
                   for name, r in result["policies"].items()])


def niah_table(result: dict) -> str:
    rows = []
    for config, s in result["summary"].items():
        kinds = s["kinds"]
        score = lambda k: f"{kinds[k]['mean_score']:.2f} ({kinds[k]['prompts']})" if k in kinds else "—"  # noqa: E731
        rows.append([config, score("single"), score("multikey"), score("multivalue"),
                     f"{s['same_score_as_dense']} / {s['compared_with_dense']}",
                     f"{s['same_text_as_dense']} / {s['compared_with_dense']}"])
    return _table(["configuration", "single needle (cells)", "multi-key", "multi-value", "same score as dense",
                   "same answer text as dense"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    makers = {"eval_exactness": exactness_tables, "eval_tradeoff": tradeoff_table, "eval_kl": kl_table,
              "eval_niah": niah_table}
    for name, make in makers.items():
        path = args.results / f"{name}.json"
        if path.exists():
            result = json.loads(path.read_text())
            print(f"### {name}: `{result['command']}` ({result['machine']['date']})\n\n{make(result)}\n")


if __name__ == "__main__":
    main()
