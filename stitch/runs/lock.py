"""One stitch process per run directory: ``OUT/.stitch.lock`` holds the owner's pid and host.

A second process on the same run directory is refused, naming the owner's pid and what it runs. A lock left by a
killed process (its pid no longer alive on this host) is taken over: the takeover is an atomic ``os.link`` of a
fresh lock file, so two processes racing for a stale lock cannot both win.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LOCK_NAME = ".stitch.lock"


class RunLockedError(RuntimeError):
    """Another live stitch process holds the run directory."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None


class RunLock:
    """``with RunLock(out_dir, "train sft"):`` holds the run directory for this process (re-entrant per process)."""

    _held: dict[Path, int] = {}

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
        fd, tmp = tempfile.mkstemp(prefix=".stitch.lock.", dir=self.run_dir)
        with os.fdopen(fd, "w") as fh:
            json.dump(record, fh)
        try:
            for _ in range(3):
                try:
                    os.link(tmp, self.path)  # atomic: fails if a lock exists
                    break
                except FileExistsError:
                    owner = _read(self.path)
                    if owner is None:  # being written or torn: look again
                        time.sleep(0.05)
                        continue
                    same_host = owner.get("host") == socket.gethostname()
                    if same_host and not _alive(int(owner.get("pid", -1))):
                        stale = self.path.with_name(f"{LOCK_NAME}.stale.{owner.get('pid')}")
                        try:
                            os.replace(self.path, stale)  # only one racer moves the stale lock away
                            stale.unlink(missing_ok=True)
                        except FileNotFoundError:
                            pass
                        continue
                    raise RunLockedError(
                        f"run directory {self.run_dir} is in use by pid {owner.get('pid')} on "
                        f"{owner.get('host')} ({owner.get('what') or 'stitch'}); wait for it to finish or use "
                        f"another --out (a lock left by a killed process on this host is taken over)") from None
            else:
                raise RunLockedError(f"could not take the lock {self.path}")
        finally:
            os.unlink(tmp)
        RunLock._held[key] = 1
        return self

    def __exit__(self, *exc: object) -> None:
        key = self.path.resolve()
        RunLock._held[key] -= 1
        if RunLock._held[key] == 0:
            del RunLock._held[key]
            owner = _read(self.path)
            if owner is not None and owner.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
