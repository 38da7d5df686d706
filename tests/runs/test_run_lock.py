"""Two stitch processes on one run directory: the second is refused with the first's pid; a stale lock from a
killed process is taken over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from stitch.runs.lock import LOCK_NAME, RunLock, RunLockedError

HOLDER = """
import sys, time
from stitch.runs.lock import RunLock
with RunLock(sys.argv[1], "train sft"):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.fixture
def holder(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


def test_a_second_process_on_a_held_run_directory_is_refused_naming_the_first_pid(tmp_path, holder):
    with pytest.raises(RunLockedError, match=rf"in use by pid {holder.pid} .*train sft"):
        with RunLock(tmp_path):
            pass
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == holder.pid


def test_the_cli_refuses_a_held_run_directory_in_one_line_before_any_work(tmp_path, holder):
    res = subprocess.run([sys.executable, "-m", "stitch", "train", "alignment", "--recipe", "demo", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 4  # the resource class (docs/errors.md): wait for the holder
    assert f"pid {holder.pid}" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "alignment").exists()


def test_a_lock_left_by_a_killed_process_is_taken_over(tmp_path, holder):
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (tmp_path / LOCK_NAME).exists()  # SIGKILL leaves the lock behind
    with RunLock(tmp_path, "train dpo"):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert not (tmp_path / LOCK_NAME).exists()


def test_the_lock_is_released_at_exit_and_reentrant_within_one_process(tmp_path):
    with RunLock(tmp_path, "run"):
        with RunLock(tmp_path, "train sft"):  # stitch run calls the stages, which take the lock again
            pass
        assert (tmp_path / LOCK_NAME).exists()
    assert not (tmp_path / LOCK_NAME).exists()


RACER = """
import os, sys, time
from stitch.runs.lock import RunLock, RunLockedError
go = sys.argv[2]
while not os.path.exists(go):
    time.sleep(0.001)
try:
    with RunLock(sys.argv[1], "race"):
        print("won", flush=True)
        time.sleep(1.5)
except RunLockedError:
    print("refused", flush=True)
"""


def test_processes_racing_for_a_killed_processs_lock_let_exactly_one_win(tmp_path, holder):
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (tmp_path / LOCK_NAME).exists()
    go = tmp_path / "go"
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(tmp_path), str(go)], stdout=subprocess.PIPE,
                               text=True) for _ in range(6)]
    import time

    time.sleep(2.0)  # every racer imported and is polling for the start
    go.touch()
    outcomes = sorted(r.communicate(timeout=60)[0].strip() for r in racers)
    assert outcomes == ["refused"] * 5 + ["won"]


def test_a_writer_under_or_over_a_held_run_directory_is_refused_naming_the_holder(tmp_path, holder):
    # `stitch prepare --out RUN/data` while `stitch train` holds RUN wrote shards beside the ones training read
    with pytest.raises(RunLockedError, match=rf"{tmp_path / 'data'} is in use \(through {tmp_path}, which holds it\) "
                                             rf"by pid {holder.pid} .*train sft"):
        with RunLock(tmp_path / "data", "prepare"):
            pass
    assert not (tmp_path / "data").exists()


def test_a_writer_over_a_held_subdirectory_is_refused(tmp_path):
    data = tmp_path / "run" / "data"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(data)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(RunLockedError, match=rf"through {data}, which holds it\) by pid {proc.pid}"):
            with RunLock(tmp_path / "run", "train sft"):
                pass
    finally:
        proc.kill()
        proc.wait()
    with RunLock(tmp_path / "run", "train sft"), RunLock(data, "prepare"):  # one process may hold both
        pass
