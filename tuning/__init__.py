"""Tuner and per-hardware profiles of louver-sgl (import name ``louver_tuning``; folder ``tuning/``).

``louver-tune tune`` runs an Optuna study for a target (``CpuTarget``; targets implement
``Target``), ``export`` writes the best trial as a profile that ``louver_sgl.profiles`` loads at
backend startup. See docs/tuning.md.
"""
