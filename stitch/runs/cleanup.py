"""Leaving a directory as it was found when a command fails: what the failed invocation created under it is removed,
and nothing that was there before is touched. It imports only ``stitch.runs``, so the data writers can use it."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from stitch.runs.lock import RunLockedError


class CreatedPaths:
    """The paths under ``root`` that did not exist when the guard started; ``commit()`` keeps them for good."""

    def __init__(self, root: Path, keep: tuple[str, ...]) -> None:
        self.root, self.keep = Path(root), keep
        self.existed = self.root.exists()
        self.before = set(self.root.rglob("*")) if self.existed else set()
        self.committed = False

    def commit(self) -> None:
        """What was written so far is a result (prepared data a later stage resumes from): a failure keeps it."""
        self.committed = True

    def remove(self) -> None:
        """Remove every path created since the guard started (deepest first), except names in ``keep`` and the
        directories that lead to them."""
        if self.committed or not self.root.exists():
            return
        created = [p for p in self.root.rglob("*") if p not in self.before]
        kept = {p for p in created if p.name in self.keep}
        needed = {parent for p in kept for parent in p.parents}
        for path in sorted(created, key=lambda p: len(p.parts), reverse=True):
            if path in kept or path in needed:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        if not self.existed and not kept and not any(self.root.iterdir()):
            self.root.rmdir()


@contextmanager
def leave_as_found(root: Path, keep: tuple[str, ...] = ()) -> Iterator[CreatedPaths]:
    """``with leave_as_found(out):`` an exception inside removes what the block created under ``out`` (and ``out``
    itself when the block created it), then propagates. ``keep`` names files a failure deliberately leaves (a
    report the error message points to)."""
    created = CreatedPaths(root, keep)
    try:
        yield created
    except RunLockedError:
        raise  # another process owns ``root``: what appeared there meanwhile is its work, not ours
    except Exception:
        created.remove()
        raise
