"""Progress that suits where it goes: a live tqdm bar on a terminal; in a log file or a pipe, one plain line every
``every_s`` seconds and one at the end, never a flood of ``\\r`` redraws."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from tqdm.auto import tqdm

LINE_EVERY_S = 30.0


class LineProgress:
    """tqdm's ``update`` / ``set_postfix`` / ``close`` as whole lines: ``desc: n/total key=value (Ns)``."""

    def __init__(self, total: int | None, desc: str, initial: int = 0, every_s: float = LINE_EVERY_S,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.desc, self.n, self.every_s = total, desc, initial, every_s
        self.stream, self.clock = stream or sys.stderr, clock
        self.start = self.last = clock()
        self.postfix: dict[str, Any] = {}
        self.closed, self.written = False, initial

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.clock() - self.last >= self.every_s:
            self.write()

    def set_postfix(self, values: dict[str, Any] | None = None, refresh: bool = True, **more: Any) -> None:
        self.postfix = {**(values or {}), **more}

    def write(self) -> None:
        self.last, self.written = self.clock(), self.n
        count = f"{self.n}/{self.total}" if self.total is not None else str(self.n)
        extra = "".join(f" {k}={v}" for k, v in self.postfix.items())
        self.stream.write(f"{self.desc}: {count}{extra} ({self.last - self.start:.0f}s)\n")
        self.stream.flush()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.n != self.written:  # the last interval's line may already say it
                self.write()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class NoProgress:
    """A disabled progress display: the same calls, no output."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, values: dict[str, Any] | None = None, refresh: bool = True, **more: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> NoProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def progress(total: int | None, desc: str, enabled: bool = True, initial: int = 0,
             stream: TextIO | None = None, **bar: Any) -> Any:
    """A tqdm bar when ``stream`` (default stderr) is a terminal, else a ``LineProgress``; ``NoProgress`` when
    disabled. ``bar`` passes tqdm options (unit, leave, dynamic_ncols)."""
    if not enabled:
        return NoProgress()
    stream = stream or sys.stderr
    if not stream.isatty():
        return LineProgress(total, desc, initial=initial, stream=stream)
    return tqdm(total=total, initial=initial, desc=desc, file=stream, **bar)


def quiet_library_bars(stream: TextIO | None = None) -> None:
    """Off a terminal, turn off the Hugging Face libraries' own bars (weights loading and writing): set before
    they are imported, as they read ``HF_HUB_DISABLE_PROGRESS_BARS`` once; a value the user set is kept."""
    if not (stream or sys.stderr).isatty():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":  # a library imported already read it: tell it
            hub, transformers_logging = (sys.modules.get(name) for name in
                                         ("huggingface_hub.utils", "transformers.utils.logging"))
            if hub is not None:
                hub.disable_progress_bars()
            if transformers_logging is not None:
                transformers_logging.disable_progress_bar()
