"""What a hardware target supplies to the tuner.

A target (CPU here; a CUDA target plugs in the same way) names its device, its kernel launch
search space and defaults, a timer, and how to place data and run one decode step with a given
(config, launch). Everything else (search over index/dispatch knobs, validation, storage,
profiles) is shared.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import torch
from optuna.distributions import BaseDistribution

from louver_sgl import LouverConfig, PageIndexStore
from louver_eval.data.paged import PagedBatch
from louver_sgl.decode.contract import StepStats
from louver_sgl.profiles import device_name, profile_key

StepFn = Callable[[], tuple[torch.Tensor, StepStats]]


@dataclass(frozen=True)
class TimedPoint:
    """What is being timed: a case label (``"8192x1/L21"``), the config and the launch parameters."""

    case: str
    config: LouverConfig
    launch: Mapping[str, Any]


class Timer(Protocol):
    """Latency in milliseconds of ``step``; ``point`` lets test timers answer deterministically."""

    def __call__(self, step: StepFn, point: TimedPoint) -> float: ...


class Target(ABC):
    """A tunable device kind. ``name`` is the profile's ``target`` ("cpu" or "cuda");
    ``code_layout`` the index stores' codes layout its steps read (None: the store's default)."""

    name: str
    code_layout: str | None = None

    def device_name(self) -> str:
        """Raw device name of this machine (recorded in the profile)."""
        return device_name(self.name)

    def profile_key(self) -> str:
        """Normalized device name: the profile's file stem."""
        return profile_key(self.name, self.device_name())

    @abstractmethod
    def launch_space(self) -> dict[str, BaseDistribution]:
        """Optuna distributions of the launch parameters (names are ``ServingOptions`` fields)."""

    @abstractmethod
    def default_launch(self) -> dict[str, Any]:
        """Launch parameters the backend uses without a profile (enqueued as the first trial)."""

    @abstractmethod
    def timer(self) -> Timer:
        """The default timer of this target."""

    @abstractmethod
    def place(self, batch: PagedBatch) -> PagedBatch:
        """``batch`` with its tensors on this target's device."""

    @abstractmethod
    def make_step(self, batch: PagedBatch, store: PageIndexStore, config: LouverConfig,
                  launch: Mapping[str, Any]) -> StepFn:
        """A closure running one decode step of ``batch`` (output ``[B, H_q, D]``, ``StepStats``)."""
