"""Helpers shared by the stage tests: small recipes written to disk and prepared once per session."""

from __future__ import annotations

import copy
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

import torch
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

BASE: dict[str, Any] = {
    "name": "small",
    "model": "qwen3.5-demo",
    "encoder": "clip-tiny",
    "projector": "mlp2x_gelu",
    "task": "counting",
    "data": {
        "source": {"builtin": "counting-shapes", "rows": 120, "caption_rows": 20, "seed": 0},
        "columns": {"id": "id", "media": "image", "question": "question", "answer": "answer"},
        "partitions": {"alignment": [0, 20], "train": [20, 80], "eval": [80, 100], "grpo": [100, 120]},
        "scan_cap": 200,
        "budgets": {"transient_mib": 512, "retained_mib": 64},
        "feature_dtype": "float16",
    },
    "stages": {
        "alignment": {"partition": "alignment", "eval_partition": None, "steps": 2, "batch_size": 2,
                      "save_every": 2},
        "sft": {"partition": "train", "eval_partition": None, "steps": 2, "batch_size": 2, "save_every": 2},
        "grpo": {"partition": "grpo", "eval_partition": None, "steps": 2, "prompts_per_step": 2, "group_size": 2,
                 "save_every": 1},
        "dpo": {"partition": "train", "eval_partition": None, "steps": 2, "pairs_per_step": 2, "save_every": 1},
    },
}


# a test worker's peak resident memory with the `stitch` subprocess it may start (two peaked at 5.6 GiB together on
# the CI machine); a machine whose workers need more or less sets STITCH_TEST_WORKER_GIB
WORKER_GIB = float(os.environ.get("STITCH_TEST_WORKER_GIB", "3"))


def available_gib() -> float:
    """Memory a new process can take without swapping: MemAvailable on Linux, else all physical memory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def auto_workers(cores: int, memory_gib: float, worker_gib: float = WORKER_GIB) -> int:
    """`pytest -n auto`'s worker count: one a core, but no more than the memory holds at ``worker_gib`` each, and
    at least one (a many-core machine with little memory otherwise swaps or kills workers)."""
    return max(1, min(cores, int(memory_gib // worker_gib)))


def write_recipe(path: Path, **overrides: Any) -> Path:
    """BASE with dotted-path overrides (``stages__sft__steps=6``), written as YAML."""
    recipe = copy.deepcopy(BASE)
    for key, value in overrides.items():
        node = recipe
        *parents, leaf = key.split("__")
        for part in parents:
            node = node[part]
        node[leaf] = value
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def copy_prepared(src_run: Path, dst_run: Path) -> None:
    shutil.copytree(src_run / "data", dst_run / "data")


def cli(*args: str) -> list[str]:
    """``python -m stitch ARGS`` with this interpreter."""
    return [sys.executable, "-m", "stitch", *args]


def start_server(run: Path, *args: str, env: dict[str, str] | None = None,
                 timeout_s: float = 240) -> tuple[subprocess.Popen, int]:
    """``stitch serve RUN ARGS`` on a free loopback port, returned once ``/health`` answers; the caller ends it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(cli("serve", str(run), "--port", str(port), *args), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc, port
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"server did not start: {proc.stdout.read()[-3000:]}") from None
            time.sleep(0.5)


def kill_after_checkpoint(args: list[str], checkpoints: Path, step: int, env: dict[str, str],
                          timeout_s: float = 240) -> None:
    """Start ``args``, SIGKILL it as soon as ``checkpoints/LATEST`` names ``step_<step>``; fail when it ends first."""
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    latest = checkpoints / "LATEST"
    deadline = time.time() + timeout_s
    try:
        while not (latest.exists() and latest.read_text().strip() == f"step_{step}"):
            assert proc.poll() is None, "the run ended before the checkpoint to kill after"
            assert time.time() < deadline, f"no checkpoint step_{step} after {timeout_s} s"
            time.sleep(0.01)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


# aten ops that read a value back from the tensor's device (on a GPU each one is a sync that drains the launch queue)
DEVICE_READS = {"nonzero", "_local_scalar_dense", "masked_scatter", "masked_select", "is_nonzero", "equal"}


class DeviceReads(TorchDispatchMode):
    """``with DeviceReads(ignore) as reads:`` records in ``reads.found`` each op inside that reads its tensor's
    device (``DEVICE_READS`` or a boolean-mask index) as ``"op at <frame>"``, except where a line of the Python
    stack contains one of the ``ignore`` markers. On the CPU this finds what would synchronise on a GPU."""

    def __init__(self, ignore: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.ignore = ignore
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = func.overloadpacket.__name__
        bool_index = op == "index" and any(t is not None and t.dtype == torch.bool for t in args[1])
        if op in DEVICE_READS or bool_index:
            stack = traceback.format_stack()
            if not any(marker in "".join(stack) for marker in self.ignore):
                self.found.append(f"{op} at {stack[-3].strip()}")
        return func(*args, **(kwargs or {}))


def prepare_inputs(recipe: Any, host: Any = None) -> dict[str, Any]:
    """What ``prepare`` takes beside the recipe, resolved from the plugin host as the CLI resolves it: the encoder's
    registration, the model's tokenizer and sentinel ids (no LM weights load), the builtin-source materialiser."""
    from stitch.demo.data import builtin_parquet
    from stitch.host.host import get_host
    from stitch.model.binding import ModelBinding

    host = get_host() if host is None else host
    binding = ModelBinding.for_recipe(recipe, host, device="cpu")
    return {"encoder_spec": binding.encoder_spec, "tokenizer": binding.tokenizer,
            "sentinel_ids": binding.sentinel_ids, "builtin": builtin_parquet}


def prepare_resolved(recipe: Any, out_dir: Path | str, host: Any = None, **kwargs: Any) -> Any:
    """``stitch.data.prepare.prepare`` with its plugin inputs resolved from ``host`` (``prepare_inputs``)."""
    from stitch.data.prepare import prepare

    return prepare(recipe, out_dir, **prepare_inputs(recipe, host), **kwargs)
