"""Every result file under benchmarks/results says how and when it was made."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _records(data) -> list[dict]:
    """The records that must carry a command and a date: the file itself, or, for files keyed by
    configuration (each key written by its own run), every value."""
    if isinstance(data, dict) and not ({"command", "commands"} & data.keys()) and data \
            and all(isinstance(v, dict) and ({"command", "commands"} & v.keys()) for v in data.values()):
        return list(data.values())
    return [data]


def _date(record: dict) -> str | None:
    machine = record.get("machine")
    return record.get("date") or (machine.get("date") if isinstance(machine, dict) else None)


@pytest.mark.parametrize("path", sorted(RESULTS.rglob("*.json")), ids=lambda p: str(p.relative_to(RESULTS)))
def test_result_file_records_its_command_and_date(path):
    data = json.loads(path.read_text())
    for record in _records(data):
        assert isinstance(record, dict), f"{path.name}: a result file is a JSON object"
        assert record.get("command") or record.get("commands"), f"{path.name}: no command recorded"
        assert _date(record), f"{path.name}: no date recorded"


def test_the_check_sees_a_missing_date(tmp_path):
    assert _date({"command": "x"}) is None
    assert _records({"a": {"command": "x"}, "b": {"command": "y"}}) == [{"command": "x"}, {"command": "y"}]
