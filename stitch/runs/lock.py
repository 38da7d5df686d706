"""One stitch process per run directory: ``OUT/.stitch.lock`` holds the owner's pid and host.

The lock is the kernel's: an exclusive ``flock`` on that file, which the holder keeps open. A second process on the
same run directory is refused, naming the owner's pid and what it runs. A killed process's lock dies with it (the
kernel drops it when the process's files close), so its file is simply taken over; there is no stale-lock judgement
that two racing processes could both pass. A holder unlinks the file on exit while still holding it, and a taker
checks that the file it locked is still the one at the path, so nobody can hold a file that no longer counts.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

LOCK_NAME = ".stitch.lock"


class RunLockedError(RuntimeError):
    """Another live stitch process holds the run directory."""


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def _held_elsewhere(path: Path) -> bool:
    """Another process holds the flock on ``path``: a shared try-lock fails against its exclusive one."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the shared lock this probe took
    return False


class RunLock:
    """``with RunLock(out_dir, "train sft"):`` holds the run directory for this process (re-entrant per process)."""

    _held: dict[Path, int] = {}
    _fds: dict[Path, int] = {}  # the open, flocked lock file of each run directory this process holds

    def __init__(self, run_dir: Path, what: str = "") -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.what = what or " ".join(sys.argv[1:3])

    def __enter__(self) -> RunLock:
        key = self.path.resolve()
        if RunLock._held.get(key):
            RunLock._held[key] += 1
            return self
        self._refuse_nested_holder()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "what": self.what, "since": time.time()}
        for _ in range(20):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise self._refusal() from None
            try:
                current = os.stat(self.path).st_ino
            except FileNotFoundError:
                current = None
            if current != os.fstat(fd).st_ino:  # its holder unlinked it on the way out: lock the new one
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps(record).encode())
            RunLock._fds[key] = fd
            break
        else:
            raise RunLockedError(f"could not take the lock {self.path}: it was replaced 20 times while taking it")
        RunLock._held[key] = 1
        return self

    def _refusal(self, path: Path | None = None) -> RunLockedError:
        path = path or self.path
        owner = None
        for _ in range(20):  # the holder writes its record just after it takes the lock
            owner = _read(path)
            if owner is not None:
                break
            time.sleep(0.05)
        owner = owner or {}
        held = "" if path == self.path else f" (through {path.parent}, which holds it)"
        return RunLockedError(
            f"run directory {self.run_dir} is in use{held} by pid {owner.get('pid', '?')} on "
            f"{owner.get('host', '?')} ({owner.get('what') or 'stitch'}); wait for it to finish or use another "
            f"--out (a killed process's lock ends with it)")

    def _refuse_nested_holder(self) -> None:
        """A writer under a held run directory (``prepare --out RUN/data`` while ``train`` holds RUN), or over one
        (``train`` on RUN while ``prepare`` holds RUN/data), is refused like a second writer of the same one."""
        resolved = self.run_dir.resolve()
        others = [d / LOCK_NAME for d in resolved.parents]
        if resolved.is_dir():
            others += list(resolved.glob(f"*/{LOCK_NAME}"))
        for other in others:
            if other in RunLock._held or not other.is_file():
                continue  # this process holds it (``stitch run`` preparing its own data), or nobody does
            if _held_elsewhere(other):
                raise self._refusal(other)

    def __exit__(self, *exc: object) -> None:
        key = self.path.resolve()
        RunLock._held[key] -= 1
        if RunLock._held[key] == 0:
            del RunLock._held[key]
            fd = RunLock._fds.pop(key)
            self.path.unlink(missing_ok=True)  # still locked: a process that opened this file finds it unlinked
            os.close(fd)
