"""The batched decode step: planning, filtering, sparse attention, and its reference."""

from .step import StepStats, dense_attention, louver_decode

__all__ = ["StepStats", "dense_attention", "louver_decode"]
