"""metrics.jsonl on resume: a torn last line (a kill mid-write, past LATEST) is dropped with one warning; a bad line
before the last is refused naming the file and the line."""

from __future__ import annotations

import json
import logging

import pytest

from stitch.runs.metrics import MetricsLog, MetricsLogError


def _log(tmp_path, text: str) -> MetricsLog:
    path = tmp_path / "metrics.jsonl"
    path.write_text(text)
    return MetricsLog(path)


def test_a_torn_last_line_is_dropped_on_resume_with_one_warning(tmp_path, caplog):
    lines = "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3))
    log = _log(tmp_path, lines + '{"step": 4, "loss": 0.2')
    with caplog.at_level(logging.WARNING, logger="stitch"):
        log.truncate_after(2)
    assert [r["step"] for r in log.read()] == [1, 2]
    assert log.path.read_text().endswith("\n")
    (warning,) = [r.getMessage() for r in caplog.records]
    assert str(log.path) in warning and "torn last line 4" in warning


def test_a_bad_line_before_the_last_is_refused_naming_the_file_and_line(tmp_path):
    log = _log(tmp_path, '{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(MetricsLogError, match=rf"{log.path}: line 2 is not a JSON record"):
        log.truncate_after(3)
    with pytest.raises(MetricsLogError, match=rf"{log.path}: line 2"):
        log.read()
