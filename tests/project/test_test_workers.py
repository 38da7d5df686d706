"""The suite's own setup: each pytest-xdist worker runs torch on one thread (tests/conftest.py), so `-n auto`'s one
worker per core does not put two spinning OpenMP threads on each core."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.mark.skipif("PYTEST_XDIST_WORKER" not in os.environ, reason="checks a pytest-xdist worker (`pytest -n`)")
def test_an_xdist_worker_runs_torch_and_its_subprocesses_on_one_thread():
    assert os.environ["OMP_NUM_THREADS"] == "1"  # what `stitch` subprocesses of a test inherit
    assert torch.get_num_threads() == 1
