"""Named decode policies of the evaluations and text windows to run them on.

Names: ``dense``, ``certified-<eps>``, ``budget-<f>`` (louver), and ``<baseline>-<fraction>``
for the comparison policies of ``louver_eval.baselines`` (``oracle_topk-0.1``, ``quest-0.1``,
``streaming-0.1``).
"""

from __future__ import annotations

import torch

from louver_sgl.config import LouverConfig
from .data.capture import first_tokens
from .baselines import BASELINES
from .hf_decode import BaselinePolicy, DecodePolicy, LouverPolicy


def louver_config(name: str, base: LouverConfig | None = None) -> LouverConfig:
    """The ``LouverConfig`` of a louver policy name (``dense``, ``certified-1e-3``, ``budget-0.1``)."""
    base = base or LouverConfig()
    if name == "dense":
        return base.with_(policy="dense")
    kind, _, value = name.partition("-")
    if kind == "certified" and value:
        return base.with_(policy="certified", eps=float(value))
    if kind == "budget" and value:
        return base.with_(policy="budget", budget=float(value))
    raise ValueError(f"unknown louver policy {name!r}; use dense, certified-<eps> or budget-<f>")


def make_policy(name: str, base: LouverConfig | None = None) -> DecodePolicy:
    """A ``DecodePolicy`` for any policy name (louver or baseline)."""
    kind, _, value = name.partition("-")
    if kind in BASELINES:
        if not value:
            raise ValueError(f"baseline policy {name!r} needs a fraction, e.g. {kind}-0.1")
        return BaselinePolicy(kind, float(value), base or LouverConfig())
    return LouverPolicy(louver_config(name, base))


def text_window_ids(tokenizer, text: str, offset_chars: int, length: int) -> torch.Tensor:
    """``length`` token ids ``[length]`` of ``text`` starting at character ``offset_chars``."""
    if not 0 <= offset_chars < len(text):
        raise ValueError(f"offset {offset_chars} outside the text ({len(text)} characters)")
    return first_tokens(tokenizer, text[offset_chars:], length)
