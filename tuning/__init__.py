"""Tuner and per-hardware profiles of louver-sgl (import name ``louver_tuning``; folder ``tuning/``)."""
