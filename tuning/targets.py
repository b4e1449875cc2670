"""Target registry: name -> "module:Class" (imported lazily). A CUDA target registers here."""

from __future__ import annotations

import importlib

import torch

from .target import Target

REGISTRY = {"cpu": "louver_tuning.cpu:CpuTarget", "cuda": "louver_tuning.cuda:CudaTarget"}


def get_target(name: str, repeats: int = 5, warmup: int = 1) -> Target:
    """The target ``name`` ("auto": CUDA when torch sees a GPU and a CUDA target is registered, else CPU)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() and "cuda" in REGISTRY else "cpu"
    if name not in REGISTRY:
        raise ValueError(f"no tuning target {name!r}; registered: {sorted(REGISTRY)} (or 'auto')")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)(repeats=repeats, warmup=warmup)
