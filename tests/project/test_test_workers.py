"""The suite's own setup: each pytest-xdist worker runs torch on one thread (tests/conftest.py), so `-n auto`'s one
worker per core does not put two spinning OpenMP threads on each core; and `-n auto` starts no more workers than the
memory holds."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.mark.skipif("PYTEST_XDIST_WORKER" not in os.environ, reason="checks a pytest-xdist worker (`pytest -n`)")
def test_an_xdist_worker_runs_torch_and_its_subprocesses_on_one_thread():
    assert os.environ["OMP_NUM_THREADS"] == "1"  # what `stitch` subprocesses of a test inherit
    assert torch.get_num_threads() == 1


def test_auto_workers_are_one_a_core_capped_by_the_memory_each_worker_needs():
    from tests.stitch_testing import auto_workers

    assert auto_workers(2, 24.0, worker_gib=2.5) == 2  # the CI machine: cores bind
    assert auto_workers(64, 32.0, worker_gib=2.5) == 12  # many cores, little memory: memory binds
    assert auto_workers(8, 1.0, worker_gib=2.5) == 1  # never none


def test_pytest_n_auto_asks_the_conftest_hook_for_its_worker_count(tmp_path):
    """With a worker said to need more memory than any machine has, `-n auto` starts one worker, not one a core."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "STITCH_TEST_WORKER_GIB": "1000000"}
    env.pop("PYTEST_XDIST_AUTO_NUM_WORKERS", None)
    one = "tests/project/test_test_workers.py::test_auto_workers_are_one_a_core_capped_by_the_memory_each_worker_needs"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "auto", "-p", "no:cacheprovider", one],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "created: 1/1 worker" in proc.stdout, proc.stdout[-2000:]
