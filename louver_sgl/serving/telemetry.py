"""Decode-step telemetry of the louver backend: log lines and Prometheus metrics.

Counters accumulate over every layer of every forward; the log line is written every
``interval`` decode forwards. With ``--enable-metrics`` the same numbers are exported as
``sglang:louver_*`` gauges and counters from the scheduler process.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("louver_sgl.serving")

# Recorded steps summed at the latest once this many have piled up (bounds the memory they hold
# when the log interval is long or off).
PENDING_LIMIT = 512


@dataclass
class _Window:
    layer_steps: int = 0
    candidates: float = 0.0
    indexed: float = 0.0
    pages_skipped: float = 0.0
    pages: float = 0.0
    mass_bound_max: float = 0.0
    fallbacks: int = 0
    requests: int = 0
    # StepStats recorded but not yet summed (see Telemetry.record_step)
    pending: list = field(default_factory=list)


@dataclass
class Telemetry:
    """Running totals plus a window that is logged and reset every ``interval`` decode forwards."""

    interval: int
    enable_metrics: bool = False
    stats_file: str | None = None  # LOUVER_STATS_FILE
    decode_forwards: int = 0
    pages_built: int = 0
    pages_reused: int = 0
    pages_rebuilt_on_read: int = 0
    window: _Window = field(default_factory=_Window)
    _metrics: dict | None = None

    def record_step(self, stats) -> None:
        """Add one layer's ``StepStats``. They are kept and summed when the window is read (or
        PENDING_LIMIT have piled up): the sums are a dozen torch calls, and after a layer's
        attention has swept the caches each costs microseconds on the decode path."""
        pending = self.window.pending
        pending.append(stats)
        if len(pending) >= PENDING_LIMIT:
            self._sum_pending()

    def _sum_pending(self) -> None:
        w = self.window
        for stats in w.pending:
            self._add(w, stats)
        w.pending.clear()

    @staticmethod
    def _add(w: _Window, stats) -> None:
        heads = stats.candidates.shape[1]
        w.layer_steps += 1
        w.candidates += float(stats.candidates.sum())
        w.indexed += float(stats.num_indexed.sum()) * heads
        w.pages_skipped += float(stats.pages_skipped.sum())
        w.pages += float(stats.num_pages.sum()) * heads
        w.mass_bound_max = max(w.mass_bound_max, float(stats.mass_bound.max()) if stats.mass_bound.numel() else 0.0)
        w.fallbacks += int(stats.dense_fallback.sum())
        w.requests += int(stats.dense_fallback.numel())

    def end_decode_forward(self) -> None:
        self.decode_forwards += 1
        if self.interval and self.decode_forwards % self.interval == 0:
            self._flush()
        self.dump()

    def dump(self) -> None:
        """Write the running totals to ``$LOUVER_STATS_FILE`` (for tests and benchmarks; off by default)."""
        path = self.stats_file
        if not path:
            return
        totals = {"decode_forwards": self.decode_forwards, "pages_built": self.pages_built,
                  "pages_reused": self.pages_reused, "pages_rebuilt_on_read": self.pages_rebuilt_on_read}
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_text(json.dumps(totals))
        tmp.replace(path)

    def snapshot(self) -> dict[str, float]:
        self._sum_pending()
        w = self.window
        return {
            "candidate_fraction": w.candidates / w.indexed if w.indexed else 0.0,
            "pages_skipped_fraction": w.pages_skipped / w.pages if w.pages else 0.0,
            "mass_bound_max": w.mass_bound_max,
            "dense_fallback_fraction": w.fallbacks / w.requests if w.requests else 0.0,
            "pages_built": self.pages_built,
            "pages_reused": self.pages_reused,
        }

    def _flush(self) -> None:
        s = self.snapshot()
        logger.info(
            "louver: candidates %.3f, pages skipped %.3f, certified dropped-mass bound <= %.2e, "
            "dense fallbacks %.3f, index pages built %d, reused %d",
            s["candidate_fraction"], s["pages_skipped_fraction"], s["mass_bound_max"],
            s["dense_fallback_fraction"], self.pages_built, self.pages_reused,
        )
        if self.enable_metrics:
            self._export(s)
        self.window = _Window()

    def _export(self, s: dict[str, float]) -> None:
        try:
            if self._metrics is None:
                self._metrics = _make_metrics()
            m = self._metrics
            m["candidates"].set(s["candidate_fraction"])
            m["skipped"].set(s["pages_skipped_fraction"])
            m["bound"].set(s["mass_bound_max"])
            m["fallback"].set(s["dense_fallback_fraction"])
            m["built"].set(self.pages_built)
            m["reused"].set(self.pages_reused)
        except Exception as exc:  # metrics must never break serving
            logger.warning("louver metrics export failed: %s", exc)
            self.enable_metrics = False


def _make_metrics() -> dict:
    from prometheus_client import Gauge

    def gauge(name: str, doc: str) -> Gauge:
        return Gauge(f"sglang:louver_{name}", doc, multiprocess_mode="mostrecent")

    return {
        "candidates": gauge("candidate_fraction", "Indexed keys attended per query head (fraction)."),
        "skipped": gauge("pages_skipped_fraction", "Indexed pages skipped by their page bound."),
        "bound": gauge("mass_bound_max", "Largest certified upper bound on dropped softmax mass."),
        "fallback": gauge("dense_fallback_fraction", "Decode requests that fell back to dense."),
        "built": gauge("index_pages_built", "Index pages built since start (all layers)."),
        "reused": gauge("index_pages_reused", "Prefix index pages read without rebuild."),
    }
