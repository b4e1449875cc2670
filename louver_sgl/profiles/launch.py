"""Applying CPU launch parameters around a decode step."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def cpu_threads(num_threads: int) -> Iterator[None]:
    """Run the body with ``torch.set_num_threads(num_threads)``, restoring the previous count.

    0 leaves the count alone. The thread count is process-wide, so it is set only around the
    attention step (the rest of the model keeps its own setting).
    """
    previous = torch.get_num_threads()
    if num_threads <= 0 or num_threads == previous:
        yield
        return
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
