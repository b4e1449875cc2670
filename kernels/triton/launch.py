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

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"launch parameter {f.name} must be a positive int, got {value!r}")
        for name in ("attend_warps", "hist_warps", "exact_warps", "build_warps", "exact_block", "min_block_g",
                     "merge_block", "merge_warps"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"launch parameter {name} must be a power of two, got {value}")

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
