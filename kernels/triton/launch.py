"""Launch parameters of the Triton kernels.

Every block size, warp count, pipeline depth and split size of the GPU path comes from here; the
active hardware profile (``louver-tune``) overrides the defaults by name.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Mapping


@dataclass(frozen=True)
class TritonLaunch:
    """Launch parameters of the GPU decode path.

    pages_per_split: pages one attention program walks (split-K granularity).
    attend_warps, attend_stages: num_warps / num_stages of the fused filter + attention kernel.
    hist_warps: num_warps of the certified-histogram kernel.
    exact_block: tokens per tile in the exact-part kernel (dense part and sample).
    exact_warps: num_warps of the exact-part kernel.
    build_warps: num_warps of the page-build kernel.
    merge_block, merge_warps: splits per tile and num_warps of the split-merge kernel.
    min_block_g: smallest query-head tile (tl.dot needs >= 16 rows).
    filter_warps, filter_stages: num_warps / num_stages of the streaming filter kernel.
    survivor_percent: capacity of a segment's survivor list, in percent of its tokens (a request
        whose segment overflows it is attended densely).
    survivor_block, survivor_warps, survivor_stages: survivors per tile, num_warps and num_stages
        of the attention over survivors.
    """

    pages_per_split: int = 16
    attend_warps: int = 4
    attend_stages: int = 2
    hist_warps: int = 4
    exact_block: int = 64
    exact_warps: int = 4
    build_warps: int = 4
    merge_block: int = 16
    merge_warps: int = 4
    min_block_g: int = 16
    filter_warps: int = 4
    filter_stages: int = 2
    survivor_percent: int = 100
    survivor_block: int = 64
    survivor_warps: int = 4
    survivor_stages: int = 2

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"launch parameter {f.name} must be a positive int, got {value!r}")
        for name in ("attend_warps", "hist_warps", "exact_warps", "build_warps", "exact_block", "min_block_g",
                     "merge_block", "merge_warps", "filter_warps", "survivor_block", "survivor_warps"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"launch parameter {name} must be a power of two, got {value}")
        if self.survivor_percent > 100:
            raise ValueError(f"launch parameter survivor_percent must be at most 100, got {self.survivor_percent}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "TritonLaunch":
        """Build from a profile's launch section, rejecting unknown keys by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown Triton launch parameters {unknown}; known: {sorted(known)}")
        return cls(**dict(values))

    def with_(self, **changes: Any) -> "TritonLaunch":
        return replace(self, **changes)
