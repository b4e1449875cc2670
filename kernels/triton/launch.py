"""Launch parameters of the Triton kernels.

Every block size, warp count, pipeline depth and split size of the GPU path comes from here; the
active hardware profile (``louver-tune``) overrides the defaults by name.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Mapping


_MAY_BE_ZERO = ("tile_atomic", "window_start")


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
    tile_pages, tile_warps, tile_stages: ``triton_tiled``'s filter: pages per program (at least
        16 / the padded GQA group, so that a tile's (page, head) rows fill a tensor-core tile),
        num_warps, num_stages.
    tile_atomic: 1: the filter writes each tile's survivors at an offset taken by one atomic per
        tile (one launch, list order unspecified); 0: into the tile's own region, then a prefix
        sum and ``compact_warps``' copy (deterministic, two more launches).
    window_start, window_edges: ``triton_tiled``'s certified histogram in one pass over the codes
        is evaluated at ``window_edges`` consecutive edges (a power of two) from the safe level's
        edge plus ``window_start``; below them the request attends densely, above them it keeps
        the top edge's keys.
    list_block, list_warps, list_stages, list_splits, list_min_rows: ``triton_tiled``'s attention
        over the lists: rows per tile, num_warps, num_stages, most splits per (request, KV head),
        fewest rows per split.
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
    tile_pages: int = 1
    tile_warps: int = 4
    tile_stages: int = 1
    tile_atomic: int = 0
    compact_warps: int = 4
    window_start: int = 4
    window_edges: int = 32
    list_block: int = 64
    list_warps: int = 4
    list_stages: int = 2
    list_splits: int = 32
    list_min_rows: int = 256

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            low = 0 if f.name in _MAY_BE_ZERO else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                kind = "a non-negative" if low == 0 else "a positive"
                raise ValueError(f"launch parameter {f.name} must be {kind} int, got {value!r}")
        if self.tile_atomic not in (0, 1):
            raise ValueError(f"launch parameter tile_atomic must be 0 or 1, got {self.tile_atomic}")
        for name in ("attend_warps", "hist_warps", "exact_warps", "build_warps", "exact_block", "min_block_g",
                     "merge_block", "merge_warps", "filter_warps", "survivor_block", "survivor_warps", "tile_pages",
                     "tile_warps", "compact_warps", "window_edges", "list_block", "list_warps"):
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
