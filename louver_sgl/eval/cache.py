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
