"""Estimate-share rules replayed on a sweep of consecutive decode steps (``share_sequence --sweep``).

The sweep holds, for every captured step of a (trace, layer, ε) and every share of its ladder,
whether a head was lowered (and in how many KV groups), the largest bound over ε and the
GQA-union fraction. A rule picks each step's share from the earlier steps' outcomes (as
``decode.share_control`` does, shares rounded down to the ladder); its cost per step is a proxy of
the step's time, ``1 + 2·union``, times ``1 + g/H_kv`` where g KV groups of H_kv were lowered (the
compiled step attends those groups again: their scan and their larger set); ``--whole-request``
prices a failure as the step did before that, doubling the cost.
Printed: each fixed share, the best fixed share per row (an oracle no rule can beat by keeping
one share per (request, layer)), and the rules of the control with their failures.

    python -m benchmarks.studies.share_control_sim benchmarks/results/share_sweep_q128_bible.json \\
        benchmarks/results/share_sweep_q128_random.json
"""

from __future__ import annotations

import argparse
import bisect
import json

from louver_sgl.decode.share_control import RAISE_AFTER, RAISE_BELOW, STEP


H_KV = 3  # SmolLM2's KV heads


def step_cost(groups: int, union: float, whole_request: bool = False) -> float:
    """The proxy of a step with ``groups`` lowered KV groups and GQA-union fraction ``union``."""
    again = (1.0 if groups else 0.0) if whole_request else groups / H_KV
    return (1.0 + again) * (1.0 + 2.0 * union)


def groups_of(row: dict, i: int) -> list[int]:
    """Lowered KV groups per step at share index ``i`` (sweeps without the count: all of them)."""
    if "lowered_groups" in row:
        return row["lowered_groups"][i]
    return [H_KV if low else 0 for low in row["lowered"][i]]


def replay(row: dict, start: float, top: float, after: int, below: float | None, down: float,
           whole: bool) -> tuple[int, float]:
    """(steps lowered, mean cost) of the control rule over one sweep row; ``below`` None: raise
    without looking at the bound."""
    ladder = sorted(row["shares"])
    index = {s: i for i, s in enumerate(row["shares"])}
    share, clean, fails, cost = start, 0, 0, 0.0
    steps = len(row["lowered"][0])
    for step in range(steps):
        i = index[ladder[max(0, bisect.bisect_right(ladder, share + 1e-9) - 1)]]
        lowered, bound, union = row["lowered"][i][step], row["bound_over_eps"][i][step], row["union"][i][step]
        fails, cost = fails + lowered, cost + step_cost(groups_of(row, i)[step], union, whole)
        if lowered:
            share, clean = max(1.0, share / down), 0
        else:
            clean += 1
            if clean >= after and (below is None or bound < below):
                share, clean = min(top, share * STEP), 0
    return fails, cost / steps


def fixed(row: dict, share: float, whole: bool) -> tuple[int, float]:
    i = row["shares"].index(share)
    steps = len(row["lowered"][i])
    cost = sum(step_cost(g, u, whole) for g, u in zip(groups_of(row, i), row["union"][i]))
    return sum(row["lowered"][i]), cost / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", nargs="+", help="share_sequence --sweep outputs")
    parser.add_argument("--whole-request", action="store_true",
                        help="price a lowered step as a second pass over the whole request")
    args = parser.parse_args()
    whole = args.whole_request
    rows = [r for path in args.sweeps for r in json.loads(open(path).read())["rows"]]
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    steps = len(rows[0]["lowered"][0])
    print(f"{len(rows)} rows (trace, layer, eps), {steps} steps each; cost per step, lower is faster")
    for share in sorted(rows[0]["shares"]):
        outcomes = [fixed(r, share, whole) for r in rows]
        print(f"fixed share {share:5.2f}: cost {mean([c for _, c in outcomes]):.3f}, steps lowered "
              f"{sum(f for f, _ in outcomes)}")
    print(f"best fixed share per row: cost {mean([min(fixed(r, s, whole)[1] for s in r['shares']) for r in rows]):.3f}")
    rules = [(start, 16.0, after, below, down) for start in (3.0, 4.0) for after in (8, RAISE_AFTER)
             for below in (None, RAISE_BELOW) for down in (2.0, STEP)]
    # the shipped raise and fall with a lower ceiling; top = start: down after a failure, back up
    # to the start (never above it)
    rules += [(start, top, RAISE_AFTER, RAISE_BELOW, STEP) for start in (3.0, 4.0) for top in (start, 2 * start)]
    for start, top, after, below, down in rules:
        outcomes = [replay(r, start, top, after, below, down, whole) for r in rows]
        shipped = (after, below, down) == (RAISE_AFTER, RAISE_BELOW, STEP)
        print(f"control from {start:g} to {top:g}: raise after {after} clean steps"
              f"{'' if below is None else f' with bound < {below}·eps'}, down /{down:.2f}: cost "
              f"{mean([c for _, c in outcomes]):.3f}, steps lowered {sum(f for f, _ in outcomes)}"
              f"{'  (decode.share_control)' if shipped else ''}")


if __name__ == "__main__":
    main()
