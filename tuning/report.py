"""Results table and plots (optimization history, parameter importances) of a study."""

from __future__ import annotations

import warnings
from pathlib import Path

import optuna
from optuna.trial import TrialState


def results_table(study: optuna.Study, top: int = 10) -> str:
    """The ``top`` best complete trials, then counts of pruned and rejected trials with reasons."""
    complete = sorted(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)), key=lambda t: t.value)
    cases = sorted({k[3:] for t in complete for k in t.user_attrs if k.startswith("ms:")},
                   key=lambda c: tuple(int(x) for x in c.split("x")))
    lines = [f"study {study.study_name}: {len(study.trials)} trials"]
    head = f"{'trial':>5} {'role':8} {'ms (geo)':>9} " + " ".join(f"{c:>9}" for c in cases) + "  params"
    lines.append(head)
    shown = complete[:top] + [t for t in complete[top:] if t.user_attrs.get("role") in ("defaults", "nearest")]
    for t in shown:
        per_case = " ".join(f"{t.user_attrs.get('ms:' + c, float('nan')):9.2f}" for c in cases)
        lines.append(f"{t.number:5d} {t.user_attrs.get('role', ''):8} {t.value:9.2f} {per_case}  {t.params}")
    pruned = study.get_trials(deepcopy=False, states=(TrialState.PRUNED,))
    failed = study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
    lines.append(f"complete {len(complete)}, pruned {len(pruned)} (hopeless), rejected/failed {len(failed)}")
    for t in failed[:5]:
        lines.append(f"  rejected trial {t.number}: {t.user_attrs.get('rejected', 'failed (see log)')}")
    return "\n".join(lines)


def importances(study: optuna.Study) -> dict[str, float]:
    """fANOVA parameter importances (empty with fewer than two complete trials)."""
    if len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))) < 2:
        return {}
    try:
        return optuna.importance.get_param_importances(study)
    except (RuntimeError, ValueError) as exc:  # e.g. a single distinct value per parameter
        warnings.warn(f"parameter importances unavailable: {exc}")
        return {}


def write_plots(study: optuna.Study, stem: Path) -> list[Path]:
    """``<stem>.history.png`` and ``<stem>.importances.png`` (matplotlib backend of optuna.visualization)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as vis

    paths = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        plots = [("history", vis.plot_optimization_history)]
        if importances(study):
            plots.append(("importances", vis.plot_param_importances))
        for name, plot in plots:
            ax = plot(study)
            path = stem.with_name(f"{stem.name}.{name}.png")
            path.parent.mkdir(parents=True, exist_ok=True)
            ax.figure.savefig(path, dpi=110, bbox_inches="tight")
            plt.close(ax.figure)
            paths.append(path)
    return paths
