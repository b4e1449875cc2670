"""Decode-step telemetry of the louver backend: log lines, the statistics file and Prometheus.

Every (request, layer) of a decode forward is one request-step, and it took one of three paths:
``sparse`` (read through the index), ``dense_short`` (no indexed page: shorter than
``min_sparse_tokens`` or than the sink and recent pages) or ``dense_fallback`` (over the
dense-fallback fraction). Key and page fractions and the certified bound are over sparse
request-steps only, so a window without one says so instead of reporting a fraction of 0.
Counters accumulate for the process and per log window (every ``interval`` decode forwards).
The statistics file (``LOUVER_STATS_FILE``) holds the process totals and, under ``requests``,
the account of each of the last ``REQUEST_LIMIT`` requests by SGLang request id (the ``rid`` a
client may set in ``/generate``): its request-steps by path, attended and skipped fractions,
certified bound, and the index pages its prefill built and reused. With ``--enable-metrics`` the
totals are ``sglang:louver_*`` Prometheus metrics of the scheduler process.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch

from ..decode.contract import StepStats

logger = logging.getLogger("louver_sgl.serving")

# Recorded steps summed at the latest once this many have piled up (bounds the memory they hold
# when the log interval is long or off).
PENDING_LIMIT = 512
# the StepStats fields Counts.add reads
SUMMED = ("candidates", "pages_skipped", "mass_bound", "num_indexed", "num_pages", "dense_fallback", "lowered")
REQUEST_LIMIT = 256  # per-request accounts kept in the statistics file (the most recent)
# SGLang's /health runs a one-token generation under this request id prefix
# (sglang.srt.constants.HEALTH_CHECK_RID_PREFIX): a router checking every few seconds would
# otherwise push every real request's account out of the statistics file within minutes
HEALTH_CHECK_PREFIX = "HEALTH_CHECK"


def pending_rows(pending: list) -> SimpleNamespace:
    """The ``SUMMED`` fields of recorded steps (of one head count) concatenated over their rows,
    in order. Steps of the compiled implementation still packed are joined packed and unpacked
    once (three concatenations instead of one unpacking per step and one per field)."""
    if all(s.packed is not None for s in pending):
        joined = StepStats.concat_packed(pending)
        return SimpleNamespace(**{f: getattr(joined, f) for f in SUMMED})
    return SimpleNamespace(**{f: torch.cat([getattr(s, f) for s in pending]) for f in SUMMED})


@dataclass
class Counts:
    """Sums over request-steps. Keys and pages are per query head (attended = after the gate)."""

    sparse_steps: int = 0
    dense_short_steps: int = 0
    dense_fallback_steps: int = 0
    indexed_keys: float = 0.0
    attended_keys: float = 0.0
    indexed_pages: float = 0.0
    pages_skipped: float = 0.0
    mass_bound_max: float = 0.0
    lowered_steps: int = 0  # sparse steps where a head's first level failed its check (attended again)

    def add(self, stats) -> None:
        """One layer's ``StepStats`` (a few host reads: called when a window is read)."""
        heads = stats.candidates.shape[1]
        fallback = stats.dense_fallback.cpu()
        short = stats.num_indexed.cpu() == 0
        sparse = sparse_rows(stats)
        self.sparse_steps += int(sparse.sum())
        self.dense_short_steps += int(short.sum())
        self.dense_fallback_steps += int((fallback & ~short).sum())
        if not bool(sparse.any()):
            return
        self.indexed_keys += float(stats.num_indexed.cpu()[sparse].sum()) * heads
        self.attended_keys += float(stats.candidates.cpu()[sparse].sum())
        self.indexed_pages += float(stats.num_pages.cpu()[sparse].sum()) * heads
        self.pages_skipped += float(stats.pages_skipped.cpu()[sparse].sum())
        self.mass_bound_max = max(self.mass_bound_max, float(stats.mass_bound.cpu()[sparse].max()))
        self.lowered_steps += int(lowered_rows(stats, sparse).sum())

    def merge(self, other: "Counts") -> None:
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            setattr(self, f.name, max(mine, theirs) if f.name == "mass_bound_max" else mine + theirs)

    def summary(self) -> dict[str, float | None]:
        """Fractions (None where they have no sparse step to be over)."""
        steps = self.sparse_steps + self.dense_short_steps + self.dense_fallback_steps
        sparse = self.sparse_steps > 0
        return {
            "request_steps": steps,
            "sparse_step_fraction": self.sparse_steps / steps if steps else None,
            "attended_fraction": self.attended_keys / self.indexed_keys if sparse and self.indexed_keys else None,
            "pages_skipped_fraction": self.pages_skipped / self.indexed_pages if sparse and self.indexed_pages else None,
            "mass_bound_max": self.mass_bound_max if sparse else None,
            "lowered_step_fraction": self.lowered_steps / self.sparse_steps if sparse else None,
        }


def sparse_rows(stats) -> torch.Tensor:
    """[B] bool on the host: the requests whose step took the sparse path (an indexed page and no
    dense fallback)."""
    return (stats.num_indexed.cpu() != 0) & ~stats.dense_fallback.cpu()


def lowered_rows(stats, sparse: torch.Tensor) -> torch.Tensor:
    """[B] bool on the host: the sparse requests (``sparse_rows``) whose check lowered a head."""
    return stats.lowered.cpu().any(1) & sparse


COUNT_FIELDS = tuple(f.name for f in dataclasses.fields(Counts))


class DeviceCounts:
    """``Counts`` summed on the device by static-shape ops, for decode steps inside CUDA graphs:
    nothing is read on the host until ``drain``. Process totals only (no per-request accounts: a
    replayed graph does not know its batch's request ids), plus the index pages built.

    values: fp64 ``[len(COUNT_FIELDS) + 1]``, the Counts fields in order, then pages built.
    """

    def __init__(self, device) -> None:
        self.values = torch.zeros(len(COUNT_FIELDS) + 1, dtype=torch.float64, device=device)

    def add(self, stats) -> None:
        """One layer's ``StepStats`` (the same sums as ``Counts.add``, by device ops)."""
        heads = stats.candidates.shape[1]
        short = stats.num_indexed == 0
        sparse = (~short & ~stats.dense_fallback).double()
        sums = torch.stack([
            sparse.sum(), short.double().sum(), (stats.dense_fallback & ~short).double().sum(),
            (stats.num_indexed.double() * sparse).sum() * heads,
            (stats.candidates.double() * sparse[:, None]).sum(),
            (stats.num_pages.double() * sparse).sum() * heads,
            (stats.pages_skipped.double() * sparse[:, None]).sum(),
        ])
        self.values[:7] += sums
        # mass bounds are >= 0, so a step with no sparse request adds a 0 that changes no max
        bound = (stats.mass_bound.double() * sparse[:, None]).amax()
        self.values[7:8] = torch.maximum(self.values[7:8], bound.reshape(1))
        self.values[8:9] += (stats.lowered.any(1).double() * sparse).sum().reshape(1)

    def add_pages_built(self, count: torch.Tensor) -> None:
        self.values[-1:] += count.double().reshape(1)

    def drain(self) -> tuple[Counts, int]:
        """(the counts, pages built) since the last drain, and zeroed (one host read)."""
        values = self.values.tolist()
        self.values.zero_()
        kinds = {f.name: f.type for f in dataclasses.fields(Counts)}
        counts = Counts(**{name: (int(v) if kinds[name] in (int, "int") else v)
                           for name, v in zip(COUNT_FIELDS, values)})
        return counts, int(values[-1])


@dataclass
class RequestAccount:
    """One request's decode request-steps (``Counts``) and the index pages its prefill built and
    reused (counted once, not per layer)."""

    steps: Counts = field(default_factory=Counts)
    pages_built: int = 0
    pages_reused: int = 0
    policy: dict | None = None  # the threshold policy its decode ran (``request_policy.describe``)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self.steps), **self.steps.summary(), "pages_built": self.pages_built,
                "pages_reused": self.pages_reused, "policy": self.policy}


@dataclass
class Telemetry:
    """Process totals plus a window that is logged and reset every ``interval`` decode forwards."""

    interval: int
    enable_metrics: bool = False
    stats_file: str | None = None  # LOUVER_STATS_FILE
    page_size: int = 0  # the server's (written to the statistics file for its readers)
    decode_forwards: int = 0
    pages_built: int = 0
    pages_reused: int = 0
    pages_rebuilt_on_read: int = 0
    mixed_policy_forwards: int = 0  # decode forwards whose requests ran more than one policy
    timing: dict = field(default_factory=lambda: {"timed_steps": 0, "step_seconds": 0.0, "backend_seconds": 0.0})
    totals: Counts = field(default_factory=Counts)
    window: Counts = field(default_factory=Counts)
    pending: list = field(default_factory=list)  # StepStats recorded but not yet summed
    pending_rids: list = field(default_factory=list)  # the request id of each pending row
    pending_layers: list = field(default_factory=list)  # the layer of each pending row (-1: not given)
    # layer -> sparse request-steps whose check lowered a head, over the process (statistics file
    # only: where in the model the a-posteriori rule's first level fails)
    lowered_by_layer: dict = field(default_factory=dict)
    requests: OrderedDict = field(default_factory=OrderedDict)  # rid -> RequestAccount
    # rid -> pages of that request's prompt already counted (reused or built) by its earlier
    # prefill chunks: their pages are the request's own, not reuse; dropped at its first decode
    prefill_counted: OrderedDict = field(default_factory=OrderedDict)
    # () -> the index's allocation (``ServingIndex.allocated``), written to the statistics file
    index_allocated: Callable[[], dict] | None = None
    # () -> None: counts kept elsewhere (``DeviceCounts`` of the CUDA path) into the window,
    # called before the telemetry is read
    collect: Callable[[], None] | None = None
    profile: str | None = None  # the startup line saying which tuned profile applied and why
    _metrics: dict | None = None

    def record_step(self, stats, rids: list[str] | None = None, layer: int | None = None) -> None:
        """Add one layer's ``StepStats`` (``rids``: the batch's request ids, for the per-request
        accounts of the statistics file; ``layer``: its layer id, for the per-layer count of
        lowered steps there). They are kept and summed when the window is read (or
        PENDING_LIMIT have piled up): the sums are a dozen torch calls, and after a layer's
        attention has swept the caches each costs microseconds on the decode path."""
        rows = stats.rows  # (a packed step stays packed: reading a field unpacks eight tensors)
        self.pending.append(stats)
        self.pending_layers.extend([-1 if layer is None else layer] * rows)
        if self.prefill_counted and rids is not None:
            for rid in rids:  # prefill done: a later request under the same id starts afresh
                self.prefill_counted.pop(rid, None)
        if self.stats_file and rids is not None and len(rids) == rows:
            self.pending_rids.extend(rids)
        else:
            self.pending_rids.extend([None] * rows)
        if len(self.pending) >= PENDING_LIMIT:
            self._sum_pending()

    def _sum_pending(self) -> None:
        """Sum the recorded steps as one: their fields concatenated over (layer, request) rows,
        so a decode forward's 30 layers cost one ``Counts.add`` (~20 torch calls), not 30; then
        the same per request id (only with a statistics file)."""
        if not self.pending:
            return
        rows = pending_rows(self.pending)
        self.window.add(rows)
        by_rid: dict[str, list[int]] = {}
        for i, rid in enumerate(self.pending_rids):
            if rid is not None:
                by_rid.setdefault(rid, []).append(i)
        for rid, index in by_rid.items():
            pick = torch.tensor(index)
            self.account(rid).steps.add(SimpleNamespace(**{f: getattr(rows, f)[pick] for f in SUMMED}))
        if self.stats_file:
            self._count_lowered_by_layer(rows)
        self.pending.clear()
        self.pending_rids.clear()
        self.pending_layers.clear()

    def _count_lowered_by_layer(self, rows) -> None:
        """The pending rows' lowered sparse steps into ``lowered_by_layer`` (rows of no layer: -1)."""
        lowered = lowered_rows(rows, sparse_rows(rows))
        if not bool(lowered.any()):
            return
        layers = torch.tensor(self.pending_layers)[lowered]
        for layer, n in zip(*torch.unique(layers, return_counts=True)):
            self.lowered_by_layer[int(layer)] = self.lowered_by_layer.get(int(layer), 0) + int(n)

    def account(self, rid: str) -> "RequestAccount":
        """The account of request ``rid`` (created, and the oldest beyond REQUEST_LIMIT dropped);
        health checks get a throw-away one (their steps still count in the totals)."""
        if rid.startswith(HEALTH_CHECK_PREFIX):
            return RequestAccount()
        if rid not in self.requests:
            self.requests[rid] = RequestAccount()
            while len(self.requests) > REQUEST_LIMIT:
                self.requests.popitem(last=False)
        self.requests.move_to_end(rid)
        return self.requests[rid]

    def note_policies(self, rids: list[str] | None, policy: dict) -> None:
        """The policy the requests ``rids`` decode with (kept in their accounts: statistics file only)."""
        if self.stats_file and rids:
            for rid in rids:
                self.account(rid).policy = policy

    def count_prefill(self, rid: str | None, built: int, prefix: int) -> None:
        """Index pages one extend of a request built, and those of its ``prefix`` pages it reused
        (one layer's count). Under chunked prefill a later chunk's prefix holds the pages the
        earlier chunks built or reused; only pages not yet counted for ``rid`` are reuse (from
        the radix cache, built by another request). Without a request id every prefix page
        counts as reused."""
        reused = prefix
        if rid is not None:
            counted = self.prefill_counted.pop(rid, 0)
            reused = max(prefix - counted, 0)
            self.prefill_counted[rid] = max(counted, prefix) + built
            while len(self.prefill_counted) > REQUEST_LIMIT:
                self.prefill_counted.popitem(last=False)
        self.pages_built += built
        self.pages_reused += reused
        if self.stats_file and rid is not None:
            acc = self.account(rid)
            acc.pages_built += built
            acc.pages_reused += reused

    def end_decode_forward(self) -> None:
        self.decode_forwards += 1
        if self.interval and self.decode_forwards % self.interval == 0:
            self._flush()
        self.dump()

    def snapshot(self) -> dict:
        """The current window's summary and the process totals (window not reset)."""
        if self.collect is not None:
            self.collect()
        self._sum_pending()
        totals = Counts(**dataclasses.asdict(self.totals))
        totals.merge(self.window)
        return {"window": {**dataclasses.asdict(self.window), **self.window.summary()},
                "totals": {**dataclasses.asdict(totals), **totals.summary()},
                "decode_forwards": self.decode_forwards, "pages_built": self.pages_built,
                "pages_reused": self.pages_reused, "pages_rebuilt_on_read": self.pages_rebuilt_on_read}

    def dump(self) -> None:
        """Write the process totals to the statistics file (off unless ``LOUVER_STATS_FILE`` is
        set; then every decode forward also sums its steps, a few host reads per layer)."""
        if not self.stats_file:
            return
        snap = self.snapshot()
        data = {**snap["totals"], "page_size": self.page_size, "decode_forwards": self.decode_forwards,
                "pages_built": self.pages_built,
                "pages_reused": self.pages_reused, "pages_rebuilt_on_read": self.pages_rebuilt_on_read,
                "mixed_policy_forwards": self.mixed_policy_forwards, **self.timing,
                "requests": {rid: acc.as_dict() for rid, acc in self.requests.items()},
                "lowered_steps_by_layer": {str(k): v for k, v in sorted(self.lowered_by_layer.items())}}
        if self.index_allocated is not None:
            data["index_allocated"] = self.index_allocated()
        if self.profile is not None:
            data["profile"] = self.profile
        tmp = Path(self.stats_file).with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self.stats_file)

    def _flush(self) -> None:
        snap = self.snapshot()
        logger.info("%s", log_line(self.window, self.pages_built, self.pages_reused, self.pages_rebuilt_on_read))
        if self.enable_metrics:
            self._export(snap["window"])
        self.totals.merge(self.window)
        self.window = Counts()

    def _export(self, window: dict) -> None:
        try:
            if self._metrics is None:
                self._metrics = _make_metrics()
            m = self._metrics
            for name in ("sparse_steps", "dense_short_steps", "dense_fallback_steps", "lowered_steps"):
                m[name].inc(window[name])
            for name in ("attended_fraction", "pages_skipped_fraction", "mass_bound_max"):
                if window[name] is not None:  # no sparse step: the gauges keep their last value
                    m[name].set(window[name])
            m["built"].set(self.pages_built)
            m["reused"].set(self.pages_reused)
        except Exception as exc:  # metrics must never break serving
            logger.warning("louver metrics export failed: %s", exc)
            self.enable_metrics = False


def log_line(window: Counts, built: int, reused: int, rebuilt: int) -> str:
    """The telemetry log line of a window."""
    s = window.summary()
    paths = (f"decode request-steps: {window.sparse_steps} sparse, {window.dense_short_steps} dense (short), "
             f"{window.dense_fallback_steps} dense (fallback)")
    pages = f"index pages built {built}, reused {reused}, rebuilt on read {rebuilt}"
    if s["attended_fraction"] is None:
        return f"louver: {paths}; no sparse step in this window; {pages}"
    lowered = f", {window.lowered_steps} lowered by their check" if window.lowered_steps else ""
    return (f"louver: {paths}{lowered}; keys attended {s['attended_fraction']:.3f} of indexed, pages skipped "
            f"{s['pages_skipped_fraction']:.3f}, certified dropped-mass bound <= {s['mass_bound_max']:.2e}; {pages}")


def _make_metrics() -> dict:
    from prometheus_client import Counter, Gauge

    def gauge(name: str, doc: str) -> Gauge:
        return Gauge(f"sglang:louver_{name}", doc, multiprocess_mode="mostrecent")

    return {
        "sparse_steps": Counter("sglang:louver_sparse_request_steps", "Decode (request, layer) steps read through the index."),
        "dense_short_steps": Counter("sglang:louver_dense_short_request_steps",
                                     "Decode (request, layer) steps attended densely: no indexed page (short request)."),
        "dense_fallback_steps": Counter("sglang:louver_dense_fallback_request_steps",
                                        "Decode (request, layer) steps over the dense-fallback fraction."),
        "lowered_steps": Counter("sglang:louver_lowered_request_steps",
                                 "Sparse decode (request, layer) steps where a certified check failed and the "
                                 "request attended again at a lowered level."),
        "attended_fraction": gauge("attended_fraction", "Indexed keys attended per query head in sparse steps."),
        "pages_skipped_fraction": gauge("pages_skipped_fraction", "Indexed pages skipped by their page bound."),
        "mass_bound_max": gauge("mass_bound_max", "Largest certified upper bound on dropped softmax mass."),
        "built": gauge("index_pages_built", "Index pages built since start (all layers)."),
        "reused": gauge("index_pages_reused",
                        "Prefix index pages read from the radix cache without rebuild (another request's)."),
    }
