"""Writing a small text file so that a reader never sees half of it: a temp file beside it, fsynced, renamed.

It imports only ``stitch.runs.diskspace`` (which imports nothing of stitch's), so any module can use it (``stitch.model.snapshots`` sits below
``stitch.runs.checkpoint`` in the import graph and writes its index JSON through it too)."""

from __future__ import annotations

import glob
import os
import re
import tempfile
from pathlib import Path

from stitch.runs.diskspace import named_when_full

_TEMP_SUFFIX = re.compile(r"[a-z0-9_]{8}")  # what tempfile.mkstemp adds after the prefix


def write_text_atomic(path: Path, text: str) -> None:
    """``text`` into ``path`` through a temp file beside it (``.<name>.XXXXXXXX``), fsynced, then renamed. A temp
    file a failed write made is removed; one a killed writer left is swept here, at the next write of the same
    path (one writer per run directory: ``RunLock``). Nothing but those temp names is touched."""
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{path.name}."
    for stale in path.parent.glob(glob.escape(prefix) + "*"):
        if _TEMP_SUFFIX.fullmatch(stale.name[len(prefix):]):
            stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=path.parent)
    try:
        with named_when_full(path, len(text.encode()), path.name), os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        with named_when_full(path, len(text.encode()), path.name):
            os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
