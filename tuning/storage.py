"""Study storage from a URL: SQLite by default, any SQLAlchemy RDB URL, or ``journal:PATH``."""

from __future__ import annotations

from pathlib import Path

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend

DEFAULT_STORAGE = "sqlite:///louver-tune.db"


def open_storage(url: str | None) -> optuna.storages.BaseStorage | str:
    """``journal:PATH`` -> a journal file storage; ``memory:`` -> the process's memory (gone when it
    ends: the quick study's default); an RDB URL (``sqlite:///f.db``, ``postgresql://...``) is
    passed to Optuna as is (several workers may share one)."""
    url = url or DEFAULT_STORAGE
    if url == "memory:":
        return optuna.storages.InMemoryStorage()
    if url.startswith("journal:"):
        path = Path(url[len("journal:"):])
        if not path.name:
            raise ValueError(f"journal storage needs a file path, got {url!r}")
        path.parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(str(path)))
    if "://" not in url:
        raise ValueError(f"storage must be an RDB URL (sqlite:///file.db) or journal:PATH, got {url!r}")
    return url
