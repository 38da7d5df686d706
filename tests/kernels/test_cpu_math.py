"""Every process that trains settles MKL's kernel choices on one thread before any parallel CPU math.

The race it prevents (pytorch/pytorch#188792) needs a loaded machine and a fresh process to show, about one resumed
process in fifteen under two parallel runs here, so these tests guard the two things it rests on: the settling
touches every op ATen sends to MKL in both float widths on the calling thread alone, and the entry points call it
before they do anything else."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from typer.testing import CliRunner

from stitch.cli.app import app
from stitch.kernels import cpu_math
from stitch.stages import loop

importlib.import_module("stitch.cli.main")  # every command module registers its commands on the app

# ATen's smallest parallel grain for these ops: a tensor below it runs on the calling thread only
SERIAL_GRAIN = 2048


class _Calls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, torch.dtype]] = set()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and func.__name__.split(".")[0] in cpu_math.VML_OPS:
            self.seen.add((func.__name__.split(".")[0], out.dtype))
            self.largest = max(self.largest, out.numel())
        return out


def test_settling_calls_every_vml_op_in_float32_and_float64_on_a_tensor_too_small_to_split():
    cpu_math.settle_cpu_math.cache_clear()
    calls = _Calls()
    with calls:
        settled = cpu_math.settle_cpu_math()
    assert set(settled) == set(cpu_math.VML_OPS)
    assert calls.seen == {(op, dtype) for op in cpu_math.VML_OPS for dtype in (torch.float32, torch.float64)}
    assert 0 < calls.largest < SERIAL_GRAIN
    with _Calls() as again:
        cpu_math.settle_cpu_math()
    assert again.seen == set()  # once a process


class _Settled(Exception):
    pass


def _refuse(*_args, **_kwargs):
    raise _Settled


def test_run_stage_settles_cpu_math_before_it_reads_the_recipe(monkeypatch, tmp_path):
    monkeypatch.setattr(loop, "settle_cpu_math", _refuse)
    with pytest.raises(_Settled):
        loop.run_stage(None, "sft", tmp_path, registry=None)  # a recipe read first would fail on None instead
    assert list(tmp_path.iterdir()) == []


def test_the_cli_settles_cpu_math_before_it_runs_a_command(monkeypatch):
    monkeypatch.setattr(cpu_math, "settle_cpu_math", _refuse)
    result = CliRunner().invoke(app, ["list-plugins"])
    assert isinstance(result.exception, _Settled)
    assert result.output == ""  # the command, which prints the plugin table, never ran


def test_stitch_help_alone_starts_without_torch():
    code = ("import sys\nsys.argv = ['stitch', '--help']\nfrom stitch.cli.main import main\ntry:\n    main()\n"
            "except SystemExit:\n    pass\nprint('torch loaded' if 'torch' in sys.modules else 'no torch')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Usage" in res.stdout and res.stdout.strip().endswith("no torch")
