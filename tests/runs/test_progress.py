"""Progress in a log file or a pipe: whole lines at most every few seconds and one at the end, never `\r` redraws;
a terminal still gets a live bar."""

from __future__ import annotations

import io
import os

from stitch.runs.progress import LineProgress, NoProgress, progress, quiet_library_bars


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_non_tty_stream_gets_one_plain_line_per_interval_and_one_at_close():
    now = [0.0]
    stream = io.StringIO()
    bar = LineProgress(100, "sft", every_s=30, stream=stream, clock=lambda: now[0])
    for _ in range(100):  # 100 steps over 100 seconds
        now[0] += 1.0
        bar.set_postfix({"loss": "0.500"})
        bar.update(1)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert lines == ["sft: 30/100 loss=0.500 (30s)", "sft: 60/100 loss=0.500 (60s)", "sft: 90/100 loss=0.500 (90s)",
                     "sft: 100/100 loss=0.500 (100s)"]


def test_progress_picks_lines_for_a_pipe_a_bar_for_a_terminal_and_nothing_when_disabled():
    assert isinstance(progress(5, "x", stream=io.StringIO()), LineProgress)
    terminal = Terminal()
    bar = progress(5, "x", stream=terminal)
    bar.update(5)
    bar.close()
    assert not isinstance(bar, LineProgress | NoProgress) and "\r" in terminal.getvalue()
    assert isinstance(progress(5, "x", enabled=False, stream=io.StringIO()), NoProgress)


def test_line_progress_takes_the_postfix_as_tqdm_does_as_a_mapping_or_keywords():
    stream = io.StringIO()
    bar = LineProgress(4, "prepare", stream=stream)
    bar.set_postfix(encoded=2, reused=1, refresh=False)
    bar.update(4)
    bar.close()
    assert stream.getvalue() == "prepare: 4/4 encoded=2 reused=1 (0s)\n"


def test_off_a_terminal_the_hugging_face_bars_are_turned_off_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    quiet_library_bars(Terminal())
    assert "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ
    quiet_library_bars(io.StringIO())
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")
    quiet_library_bars(io.StringIO())
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "0"


def test_close_adds_no_second_line_when_the_last_interval_already_reported_the_end():
    now = [0.0]
    stream = io.StringIO()
    bar = LineProgress(2, "sft", every_s=30, stream=stream, clock=lambda: now[0])
    bar.update(1)
    now[0] = 31.0
    bar.update(1)
    bar.close()
    assert stream.getvalue().splitlines() == ["sft: 2/2 (31s)"]


def test_off_a_terminal_an_already_imported_transformers_stops_drawing_its_loading_bars(monkeypatch):
    """The CLI imports transformers before it calls quiet_library_bars: the environment variable alone is read too
    late, so the library's own switch is turned."""
    from transformers.utils import logging as transformers_logging

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    transformers_logging.enable_progress_bar()
    try:
        quiet_library_bars(io.StringIO())
        assert not transformers_logging.is_progress_bar_enabled()
    finally:
        transformers_logging.enable_progress_bar()
