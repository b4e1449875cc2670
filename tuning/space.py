"""The search space: index layout and dispatch knobs of ``LouverConfig`` plus the target's launch space.

Family-specific knobs are conditional (define-by-run): ``grid_bits`` is only suggested for the grid
family, the clustered knobs only for the clustered family. ``min_sparse_tokens`` is capped at half
the longest tuned context so a profile never switches the sparse path off for the contexts it was
tuned for (turning louver off is the user's ``policy=dense``, not a tuning result).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import optuna
from optuna.distributions import (BaseDistribution, CategoricalDistribution, FloatDistribution,
                                  IntDistribution)

from louver_sgl import LouverConfig
from louver_sgl.profiles.format import CERTIFIED_ONLY

# parameter -> (parent parameter, value the parent must have for this one to exist)
CONDITIONS = {
    "grid_bits": ("family", "grid"),
    "n_subspaces": ("family", "clustered"),
    "cluster_size": ("family", "clustered"),
    "clustering": ("family", "clustered"),
    "residual_norms": ("family", "clustered"),
    "estimate_share": ("certified_rule", "a_posteriori"),
}


def config_space(max_context: int) -> dict[str, BaseDistribution]:
    """Distributions of the tuned ``LouverConfig`` fields (never the accuracy knobs).

    ``certified_passes`` and ``certified_rule`` are how a certified step finds its T, not how much
    mass it may drop: every rule certifies ε (the one-pass rules read the codes once and attend more
    keys; the a-posteriori rules divide by the mass attended and attend fewer). ``estimate_share``
    (a-posteriori only) places the first level: a larger share keeps fewer keys while the check
    passes, and a failing check costs a second attend pass, so the best share depends on how
    peaked the workload's attention is."""
    min_sparse = [0] + [n for n in (1024, 2048, 4096, 8192, 16384, 32768, 65536) if n <= max_context // 2]
    return {
        "page_size": CategoricalDistribution([32, 64, 128]),
        "family": CategoricalDistribution(["grid", "clustered"]),
        "grid_bits": CategoricalDistribution([2, 4, 8]),
        "n_subspaces": CategoricalDistribution([8, 16, 32]),
        "cluster_size": CategoricalDistribution([2, 4, 8]),
        "clustering": CategoricalDistribution(["kd"]),
        "residual_norms": CategoricalDistribution([False, True]),
        "sink_pages": IntDistribution(0, 4),
        "recent_pages": IntDistribution(0, 4),
        "dense_fallback_fraction": FloatDistribution(0.2, 1.0, step=0.1),
        "min_sparse_tokens": CategoricalDistribution(min_sparse),
        "certified_passes": CategoricalDistribution([2, 1]),
        "certified_rule": CategoricalDistribution(["histogram", "a_posteriori"]),
        "estimate_share": CategoricalDistribution([1.0, 2.0, 3.0, 4.0, 6.0, 8.0]),
    }


@dataclass(frozen=True)
class SearchSpace:
    """Config and launch distributions; ``launch_names`` tells which parameters are launch parameters."""

    distributions: Mapping[str, BaseDistribution]
    launch_names: frozenset[str]
    conditions: Mapping[str, tuple[str, Any]] = field(default_factory=lambda: dict(CONDITIONS))

    def suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        """Suggest every active parameter (parents first, in the order of ``distributions``)."""
        params: dict[str, Any] = {}
        for name, dist in self.distributions.items():
            parent = self.conditions.get(name)
            if parent is None or params.get(parent[0]) == parent[1]:
                params[name] = suggest_from(trial, name, dist)
        return params

    def split(self, params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(LouverConfig overrides, launch parameters) of a trial's parameters."""
        config = {k: v for k, v in params.items() if k not in self.launch_names}
        launch = {k: v for k, v in params.items() if k in self.launch_names}
        return config, launch

    def restrict(self, choices: Mapping[str, list]) -> "SearchSpace":
        """A sub-space where each named parameter takes only the given values."""
        unknown = sorted(set(choices) - set(self.distributions))
        if unknown:
            raise ValueError(f"unknown search parameters {unknown}; known: {sorted(self.distributions)}")
        dists = dict(self.distributions)
        dists.update({k: CategoricalDistribution(list(v)) for k, v in choices.items()})
        return SearchSpace(dists, self.launch_names, self.conditions)

    def held(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """``params`` with each parameter this space holds at one value set to it (a seed from a
        profile tuned under another policy may name other values of the knobs a study holds)."""
        single = {k: d.choices[0] for k, d in self.distributions.items()
                  if isinstance(d, CategoricalDistribution) and len(d.choices) == 1}
        return {k: single.get(k, v) for k, v in params.items()}

    def grid(self) -> dict[str, list]:
        """Values per parameter for ``GridSampler``: every parameter must be categorical, and a
        conditional parameter is included only where its parent is fixed to the enabling value."""
        grid: dict[str, list] = {}
        for name, dist in self.distributions.items():
            parent = self.conditions.get(name)
            if parent is not None and grid.get(parent[0]) != [parent[1]]:
                continue
            if not isinstance(dist, CategoricalDistribution):
                raise ValueError(f"grid search needs categorical parameters; {name} is {type(dist).__name__}")
            grid[name] = list(dist.choices)
        return grid

    def defaults(self, launch: Mapping[str, Any]) -> dict[str, Any]:
        """The parameters of the built-in defaults (``LouverConfig()`` and ``launch``), active ones only."""
        base = LouverConfig()
        values = {name: getattr(base, name) for name in self.distributions if name not in self.launch_names}
        values.update({k: v for k, v in launch.items() if k in self.launch_names})
        active = {}
        for name, dist in self.distributions.items():
            parent = self.conditions.get(name)
            if (parent is None or active.get(parent[0]) == parent[1]) and contains(dist, values[name]):
                active[name] = values[name]  # a default outside a restricted space is left to the sampler
        return active


# launch knobs the ``small`` preset keeps at their defaults (the ``full`` and quick spaces search them)
SMALL_FIXED_LAUNCH = {"one_scan": True, "residual_weights": False}


def build_space(launch_space: Mapping[str, BaseDistribution], max_context: int, preset: str = "full") -> SearchSpace:
    """The ``full`` space, or ``small``: a grid-family sub-space small enough to search exhaustively
    (the compiled CPU step's ``one_scan`` and ``residual_weights`` at their defaults)."""
    space = SearchSpace({**config_space(max_context), **launch_space}, frozenset(launch_space))
    if preset == "full":
        return space
    if preset == "small":
        base = LouverConfig()
        fixed = {name: [getattr(base, name)] for name in ("sink_pages", "recent_pages", "dense_fallback_fraction",
                                                         "min_sparse_tokens", "certified_passes",
                                                         "certified_rule")}
        launch = {k: [v for v in (16, 64, 256) if v in d.choices] if k == "chunk_pages" else list(d.choices)
                  for k, d in launch_space.items() if isinstance(d, CategoricalDistribution)}
        launch.update({k: [v] for k, v in SMALL_FIXED_LAUNCH.items() if k in launch})
        return space.restrict({"family": ["grid"], "page_size": [32, 64, 128], "grid_bits": [4, 8],
                               **fixed, **launch})
    raise ValueError(f"space preset must be 'full' or 'small', got {preset!r}")


def policy_space(space: SearchSpace, policy: str, default_launch: Mapping[str, Any]) -> SearchSpace:
    """``space`` as a study under ``policy`` searches it: the knobs only certified steps read
    (``CERTIFIED_ONLY``) are held at their defaults under any other policy, where they change
    nothing but would cost trials."""
    if LouverConfig(policy=policy).threshold.certified:
        return space
    defaults = space.defaults(default_launch)
    return space.restrict({k: [defaults[k]] for k in CERTIFIED_ONLY if k in defaults})


def suggest_from(trial: optuna.Trial, name: str, dist: BaseDistribution) -> Any:
    """``trial.suggest_*`` for a distribution object."""
    if isinstance(dist, CategoricalDistribution):
        return trial.suggest_categorical(name, dist.choices)
    if isinstance(dist, IntDistribution):
        return trial.suggest_int(name, dist.low, dist.high, step=dist.step, log=dist.log)
    if isinstance(dist, FloatDistribution):
        return trial.suggest_float(name, dist.low, dist.high, step=dist.step, log=dist.log)
    raise TypeError(f"unsupported distribution for {name}: {type(dist).__name__}")


def contains(dist: BaseDistribution, value: Any) -> bool:
    """Whether ``value`` is a point of ``dist``."""
    try:
        return bool(dist._contains(dist.to_internal_repr(value)))
    except (ValueError, TypeError):
        return False
