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

    def _refusal(self) -> RunLockedError:
        owner = None
        for _ in range(20):  # the holder writes its record just after it takes the lock
            owner = _read(self.path)
            if owner is not None:
                break
            time.sleep(0.05)
        owner = owner or {}
        return RunLockedError(
            f"run directory {self.run_dir} is in use by pid {owner.get('pid', '?')} on {owner.get('host', '?')} "
            f"({owner.get('what') or 'stitch'}); wait for it to finish or use another --out (a killed process's "
            f"lock ends with it)")

    def __exit__(self, *exc: object) -> None:
        key = self.path.resolve()
        RunLock._held[key] -= 1
        if RunLock._held[key] == 0:
            del RunLock._held[key]
            fd = RunLock._fds.pop(key)
            self.path.unlink(missing_ok=True)  # still locked: a process that opened this file finds it unlinked
            os.close(fd)
