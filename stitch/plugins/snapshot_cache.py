"""Tiny presets' snapshots, built once into the stitch cache (``$STITCH_CACHE``): where a ``ModelSource`` with a
builder reads its weights and tokenizer from."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    """``$STITCH_CACHE`` or ``~/.cache/stitch``."""
    return Path(os.environ.get("STITCH_CACHE", Path.home() / ".cache" / "stitch"))


def snapshot_dir(key: str) -> Path:
    """Where the built snapshot for ``key`` lives: one directory per transformers version. A build records the
    version in its config files and runs that version's model code, so a cache filled by the quickstart's install
    (the newest transformers in range) is not what the test install's pinned one builds."""
    import transformers  # deferred: stitch --help skips transformers (its version names the directory)

    return cache_root() / "snapshots" / f"{key}@transformers-{transformers.__version__}"


def snapshot_ready(key: str) -> bool:
    """Whether the snapshot for ``key`` is built (its ``.complete`` marker is written last)."""
    return (snapshot_dir(key) / ".complete").exists()


def ensure_snapshot(key: str, builder: Callable[[Path], None]) -> Path:
    """The snapshot directory for ``key``, running ``builder(tmpdir)`` and renaming it into place once."""
    final = snapshot_dir(key)
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
