"""Every ``LOUVER_*`` environment variable, read in one place (``Environment.read``).

SGLang has no plugin CLI flags and environment variables reach every scheduler subprocess, so the
backend's options come from them: one ``LOUVER_<OPTION>`` per ``LouverConfig`` field and per
``ServingOptions`` field, and the variables of this module's ``Environment`` (profile choice,
kernel cache, statistics file, tuning storage). A ``LOUVER_*`` variable that is none of these is
an error naming it (a misspelt option would otherwise be ignored silently).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from .config import LouverConfig

ENV_PREFIX = "LOUVER_"


@dataclass(frozen=True)
class ServingOptions:
    """Options of the SGLang backend that are not index or threshold settings.

    chunk_pages: pages per split of the compiled CPU kernel (a launch parameter).
    one_scan: certified steps of the compiled CPU kernel read the codes once (``CpuLaunch``; a
        launch parameter).
    residual_weights: the compiled CPU kernel's token bounds with residual int8 weights, as tight
        as fp32 bounds for a second integer dot per token (``CpuLaunch``; a launch parameter).
    num_threads: torch threads of the CPU decode step (a launch parameter; 0: leave torch's count).
    log_interval: decode steps between telemetry log lines (0: SGLang's decode-log interval).
    huge_pages: move a CPU KV pool onto transparent huge pages at startup (~4 ms per MiB, once;
        the index always asks for them). The step reads rows scattered over the pool, and with
        4 KiB pages nearly each read also misses the TLB (``louver_sgl.memory``).
    step_timing: time every CPU decode step and the backend's own work around it (written to the
        statistics file: ``step_seconds``, ``backend_seconds``, ``timed_steps``); a profiling aid.
    extend_backend: the SGLang attention backend that runs prefill/extend (dense), e.g.
        ``flashinfer``, ``fa3``, ``triton``, ``torch_native``, ``intel_amx``; ``auto``: SGLang's own
        choice for the device (``serving.extend``).
    cuda_decode: the decode implementation on CUDA devices: ``triton`` (filter and attention fused
        per split), ``triton_stream`` (a filter pass that compacts survivors, then attention over
        them), ``triton_tiled`` (a filter over page tiles into one list per request and KV head,
        then attention over the lists) or ``auto``: the CUDA profile's ``cuda_dispatch`` rules
        choose per batch size (``decode.dispatch``; ``triton`` without rules); a launch parameter
        of CUDA profiles, searched by ``louver-tune``.
    sleep_on_idle: on CPU, turn on SGLang's ``--sleep-on-idle`` (its scheduler then waits on its
        sockets instead of polling them: an idle server otherwise keeps a core busy; a paired run
        measured no cost to TTFT or TPOT, docs/benchmarks.md "An idle server").

    Launch parameters of tuned profiles are fields of this class.
    """

    chunk_pages: int = 64
    one_scan: bool = True
    residual_weights: bool = False
    num_threads: int = 0
    log_interval: int = 0
    huge_pages: bool = True
    step_timing: bool = False
    extend_backend: str = "auto"
    cuda_decode: str = "auto"
    sleep_on_idle: bool = True

    def __post_init__(self) -> None:
        for name, low in (("chunk_pages", 1), ("num_threads", 0), ("log_interval", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                kind = "a positive" if low else "a non-negative"
                raise ValueError(f"{name} must be {kind} int, got {value!r}")
        for name in ("one_scan", "residual_weights", "huge_pages", "step_timing", "sleep_on_idle"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.extend_backend, str) or not self.extend_backend.strip():
            raise ValueError(f"extend_backend must be a backend name or 'auto', got {self.extend_backend!r}")
        if self.cuda_decode not in CUDA_DECODE:
            raise ValueError(f"cuda_decode must be one of {list(CUDA_DECODE)}, got {self.cuda_decode!r}")


CUDA_DECODE = ("auto", "triton", "triton_stream", "triton_tiled")  # ``auto``: the profile's dispatch rules
OPTION_FIELDS = {f.name: f for cls in (LouverConfig, ServingOptions) for f in dataclasses.fields(cls)}

# variable -> (Environment field, meaning)
_VARIABLES = {
    "LOUVER_CONFIG": ("config_file", "JSON file with any of the options"),
    "LOUVER_PROFILE": ("profile", "tuned profile file to use; 'none': LouverConfig's plain values (no profile)"),
    "LOUVER_PROFILE_DIR": ("profile_dir", "directory searched for <device key>.json before the shipped profiles"),
    "LOUVER_KERNEL_CACHE": ("kernel_cache", "where the compiled CPU kernels are cached"),
    "LOUVER_DISABLE_CPU_KERNELS": ("disable_cpu_kernels", "1: never build or load the compiled CPU kernels"),
    "LOUVER_STATS_FILE": ("stats_file", "write the running index counters as JSON to this file"),
    "LOUVER_TUNE_STORAGE": ("tune_storage", "default Optuna storage of louver-tune"),
    "LOUVER_VENV": ("venv", "the virtual environment the project's scripts create"),
}


@dataclass(frozen=True)
class Environment:
    """The ``LOUVER_*`` variables of a process. ``options`` holds the raw ``LOUVER_<OPTION>``
    strings by option name (parsed by ``serving.options.load_options``)."""

    config_file: str | None = None
    profile: str | None = None
    profile_dir: str | None = None
    kernel_cache: str | None = None
    disable_cpu_kernels: bool = False
    stats_file: str | None = None
    tune_storage: str | None = None
    venv: str | None = None
    data_home: str | None = None  # XDG_DATA_HOME (the user profile directory lies under it)
    options: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> "Environment":
        """Read ``environ`` (default ``os.environ``); ``ValueError`` names an unknown variable."""
        environ = os.environ if environ is None else environ
        values, options = {}, {}
        for name, raw in environ.items():
            if not name.startswith(ENV_PREFIX):
                continue
            option = name[len(ENV_PREFIX):].lower()
            if name in _VARIABLES:
                values[_VARIABLES[name][0]] = raw
            elif option in OPTION_FIELDS:
                options[option] = raw
            else:
                raise ValueError(_unknown(name))
        flag = values.pop("disable_cpu_kernels", "0").strip().lower()
        if flag not in ("0", "1", "", "true", "false"):
            raise ValueError(f"LOUVER_DISABLE_CPU_KERNELS={flag!r}: expected 1 or 0")
        return cls(**values, disable_cpu_kernels=flag in ("1", "true"), data_home=environ.get("XDG_DATA_HOME") or None,
                   options=options)

    @property
    def user_profile_dir(self) -> Path:
        """Where ``louver-tune tune --quick`` writes this machine's profiles and the backend looks
        for them (after ``LOUVER_PROFILE_DIR``, before the shipped ones)."""
        base = Path(self.data_home) if self.data_home else Path.home() / ".local" / "share"
        return base / "louver_sgl" / "profiles"

    @property
    def kernel_cache_dir(self) -> Path:
        return Path(self.kernel_cache) if self.kernel_cache else Path.home() / ".cache" / "louver_sgl" / "kernels"


def _unknown(name: str) -> str:
    known = sorted(_VARIABLES) + sorted(ENV_PREFIX + o.upper() for o in OPTION_FIELDS)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"unknown louver variable {name}{hint} (known: {', '.join(known)})"


def variable_table() -> list[tuple[str, str]]:
    """(variable, meaning) of every variable that is not an option, for the docs."""
    return [(name, meaning) for name, (_, meaning) in _VARIABLES.items()]
