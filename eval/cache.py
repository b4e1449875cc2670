"""Resumable evaluation runs: one JSON file per finished cell, skipped when already present."""

from __future__ import annotations

import json
import platform
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import torch

DEFAULT_CACHE = Path("data/eval_cache")


def cached_cell(path: Path, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Return the JSON at ``path`` if it exists, else ``compute()`` written atomically to ``path``."""
    if path.exists():
        return json.loads(path.read_text())
    result = compute()
    write_json(path, result)
    return result


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON, atomically (a killed run leaves no half-written cell)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def machine_info() -> dict[str, Any]:
    """Hardware and software of this run, recorded beside every result file."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
            "commit": _git_commit()}


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def add_run_arguments(parser, name: str, small_help: str, threads: bool = True) -> None:
    """The options the evaluation commands share: cache, output, CI size (and torch threads)."""
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE / name, help="per-cell cache directory")
    parser.add_argument("--out", type=Path, default=Path(f"benchmarks/results/eval_{name}.json"))
    parser.add_argument("--small", action="store_true", help=small_help)
    if not threads:
        return
    # 1 thread: the per-step work is many small tensor ops, which extra threads slow down
    # (and the evaluation machine's cores are shared).
    parser.add_argument("--threads", type=int, default=1, help="torch threads")


def command_line(module: str, small: bool) -> str:
    """How a result file was produced, recorded in it."""
    return f"python -m benchmarks.quality.{module}" + (" --small" if small else "")
