"""``leave_as_found``: a failure removes what the block created (and a directory it created), keeps what was there,
keeps the files named in ``keep``; a committed guard and a refused lock remove nothing."""

from __future__ import annotations

import pytest

from stitch.runs.cleanup import leave_as_found
from stitch.runs.lock import RunLockedError


def test_a_failure_removes_what_the_block_created_and_keeps_what_was_there(tmp_path):
    out = tmp_path / "out"
    (out / "feature-cache").mkdir(parents=True)
    (out / "feature-cache" / "old.safetensors").write_bytes(b"old")
    with pytest.raises(ValueError), leave_as_found(out):
        (out / "feature-cache" / "new.safetensors").write_bytes(b"new")
        (out / "sub" / "deep").mkdir(parents=True)
        (out / "sub" / "deep" / "x").write_text("x")
        raise ValueError("refused")
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == ["feature-cache", "feature-cache/old.safetensors"]


def test_a_directory_the_block_created_is_removed_unless_a_kept_file_is_in_it(tmp_path):
    out = tmp_path / "fresh"
    with pytest.raises(ValueError), leave_as_found(out):
        (out / "feature-cache").mkdir(parents=True)
        raise ValueError("refused")
    assert not out.exists()
    with pytest.raises(ValueError), leave_as_found(out, keep=("prepare-report.json",)):
        (out / "feature-cache").mkdir(parents=True)
        (out / "prepare-report.json").write_text("{}")
        raise ValueError("refused")
    assert [p.name for p in out.iterdir()] == ["prepare-report.json"]


def test_a_committed_guard_and_a_lock_refusal_remove_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError), leave_as_found(out) as created:
        (out / "data").mkdir(parents=True)
        created.commit()
        raise ValueError("a later stage failed")
    assert (out / "data").is_dir()
    with pytest.raises(RunLockedError), leave_as_found(out):
        (out / "other-process-wrote-this").write_text("theirs")
        raise RunLockedError("held")
    assert (out / "other-process-wrote-this").exists()
