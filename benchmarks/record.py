"""Every result file says how and when it was made: the command line that wrote it and the date."""

from __future__ import annotations

import json
import sys
from datetime import date
from pathlib import Path
from typing import Any


def command_line() -> str:
    """This process's command as a user would type it (``python -m benchmarks.x ...`` for modules)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = f"python -m {spec.name}" if spec is not None and spec.name else f"python {sys.argv[0]}"
    return " ".join([head, *sys.argv[1:]])


def stamped(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` with ``command`` and ``date`` first (values already in it win)."""
    return {"command": command_line(), "date": date.today().isoformat(), **result}


def write_result(path: str | Path, result: dict[str, Any]) -> None:
    """Write ``stamped(result)`` as indented JSON to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stamped(result), indent=1) + "\n")
