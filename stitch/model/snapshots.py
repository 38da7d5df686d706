"""Locally built snapshots (tiny presets): built once into the stitch cache, atomically."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    """``$STITCH_CACHE`` or ``~/.cache/stitch``."""
    return Path(os.environ.get("STITCH_CACHE", Path.home() / ".cache" / "stitch"))


def ensure_snapshot(key: str, builder: Callable[[Path], None]) -> Path:
    """The snapshot directory for ``key``, running ``builder(tmpdir)`` and renaming it into place once."""
    final = cache_root() / "snapshots" / key
    if (final / ".complete").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=final.parent))
    try:
        builder(tmp)
        (tmp / ".complete").write_text("ok\n")
        try:
            os.rename(tmp, final)
        except OSError:
            # another process finished first (or a stale partial dir exists without .complete)
            if (final / ".complete").exists():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
