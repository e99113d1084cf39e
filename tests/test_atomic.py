"""longspec.atomic: a write lands whole or not at all, and creates the folder it writes into."""

import json

import pytest

from longspec.atomic import write_json_atomic, write_text_atomic


def test_write_creates_missing_folders_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "out" / "nested" / "result.json"
    write_json_atomic(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in path.parent.iterdir()] == ["result.json"]


def test_a_write_that_fails_midway_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "result.json"
    write_text_atomic(path, "old\n")

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("longspec.atomic.os.fsync", disk_full)  # after the temp file is written
    with pytest.raises(OSError):
        write_json_atomic(path, {"new": 1})
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # the temp file removed
