"""``write_text_atomic`` (LATEST, summaries, the resolved recipe, metrics, infer's output): a failed write leaves the
previous file and no temp file; a temp file a killed writer left is swept at the next write of the same path, and
nothing else beside it is touched."""

from __future__ import annotations

import os
import tempfile

import pytest

from stitch.runs.atomic import write_text_atomic


def test_a_failed_write_keeps_the_previous_text_and_leaves_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "LATEST"
    write_text_atomic(path, "step_1\n")

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_text_atomic(path, "step_2\n")
    assert path.read_text() == "step_1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST"]


def test_a_killed_writers_temp_file_is_swept_at_the_next_write_and_nothing_else_is_touched(tmp_path):
    path = tmp_path / "summary.json"
    fd, left = tempfile.mkstemp(prefix=".summary.json.", dir=tmp_path)  # what a writer killed mid-write leaves
    os.close(fd)
    others = [".summary.json.backup-by-hand", ".summary.json.ABCDEFGH", ".LATEST.abcdefgh", "summary.json.abcdefgh"]
    for name in others:
        (tmp_path / name).write_text("mine")
    write_text_atomic(path, "{}")
    assert path.read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*others, "summary.json"])
    assert not os.path.exists(left)
