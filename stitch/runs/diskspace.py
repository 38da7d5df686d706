"""Free space before a write whose size is known, and a full disk named as one: ``DiskFullError`` carries the path
and the bytes needed. It imports nothing of stitch's, so the data and checkpoint writers can both use it."""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

HEADROOM_BYTES = 1 << 20  # headers, JSON sidecars and filesystem blocks beyond the tensor bytes


class DiskFullError(OSError):
    """Not enough free space for a write; the message names the path, the bytes needed and the bytes free."""

    def __init__(self, path: Path, needed: int, free: int, what: str) -> None:
        super().__init__(errno.ENOSPC, f"No space left for {what} at {path}: needs about {_size(needed)}, "
                                       f"{_size(free)} free; free space on that filesystem or write elsewhere")
        self.path, self.needed, self.free = Path(path), needed, free

    def __str__(self) -> str:
        return str(self.strerror)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem holding ``path`` (its nearest existing parent)."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def check_free_space(path: Path, needed: int, what: str) -> None:
    """Refuse, before writing, a write of ``needed`` bytes (plus ``HEADROOM_BYTES``) at ``path`` that cannot fit."""
    free = free_bytes(path)
    if free < needed + HEADROOM_BYTES:
        raise DiskFullError(path, needed + HEADROOM_BYTES, free, what)


def is_disk_full(exc: BaseException, path: Path) -> bool:
    """``exc`` is a full disk: ``ENOSPC``, or a C++ writer's stream error (torch.save reports a short write as a
    RuntimeError with no errno) while the filesystem at ``path`` has less than ``HEADROOM_BYTES`` free."""
    if isinstance(exc, DiskFullError):
        return False  # already named
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(exc, RuntimeError) and free_bytes(path) < HEADROOM_BYTES


@contextmanager
def named_when_full(path: Path, needed: int, what: str) -> Iterator[None]:
    """Turn a full disk inside the block (``is_disk_full``) into one ``DiskFullError`` naming ``path``."""
    try:
        yield
    except (OSError, RuntimeError) as exc:
        if not is_disk_full(exc, path):
            raise
        raise DiskFullError(path, needed + HEADROOM_BYTES, free_bytes(path), what) from exc
