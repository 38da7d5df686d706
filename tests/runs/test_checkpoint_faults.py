"""Checkpoint writes under faults: an ENOSPC at every write site of a step is one ``DiskFullError`` naming the step,
and leaves LATEST, the steps already written and no temp dir; a step that cannot fit is refused before a byte is
written; a killed write's temp dir is swept at the next start; a LATEST holding binary is named; every generator
(torch, python, numpy) round-trips through rng.pt."""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import stitch.runs.checkpoint as checkpoint
import stitch.runs.diskspace as diskspace
from stitch.runs.checkpoint import (
    CheckpointIntegrityError,
    latest_step_dir,
    load_step_state,
    save_step,
    sweep_partial_steps,
)
from stitch.runs.diskspace import DiskFullError


def _payload(d: Path) -> None:
    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(d / "weights.safetensors"))


def _optimizer() -> torch.optim.Optimizer:
    param = torch.nn.Parameter(torch.ones(8))
    opt = torch.optim.AdamW([param])
    param.grad = torch.ones(8)
    opt.step()
    return opt


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _at(name: str, real):
    """``real`` except for a write of a file called ``name``, which fails with ENOSPC."""
    def write(*args, **kwargs):
        target = next((a for a in args if isinstance(a, str | Path) and Path(a).name == name), None)
        if target is None and args and isinstance(args[0], Path) and args[0].name == name:
            target = args[0]
        if target is not None:
            Path(target).write_bytes(b"half")  # some bytes land before the disk fills
            _full()
        return real(*args, **kwargs)
    return write


SITES = {
    "weights": lambda mp: None,  # the payload below fails after writing part of the adapter
    "optimizer.pt": lambda mp: mp.setattr(checkpoint.torch, "save", _at("optimizer.pt", torch.save)),
    "rng.pt": lambda mp: mp.setattr(checkpoint.torch, "save", _at("rng.pt", torch.save)),
    "trainer_state.json": lambda mp: mp.setattr(Path, "write_text", _at("trainer_state.json", Path.write_text)),
    "SHA256SUMS.json": lambda mp: mp.setattr(Path, "write_text", _at("SHA256SUMS.json", Path.write_text)),
    "LATEST": lambda mp: mp.setattr(os, "replace", _full),
}


@pytest.mark.parametrize("site", list(SITES))
def test_enospc_at_each_write_site_is_one_named_error_and_leaves_latest_and_earlier_steps(tmp_path, monkeypatch,
                                                                                         site):
    root = tmp_path / "checkpoints"
    save_step(root, 1, _payload, _optimizer(), {"data": {}})
    before = _snapshot(root)
    SITES[site](monkeypatch)

    def payload(d: Path) -> None:
        _payload(d)
        if site == "weights":
            (d / "adapter.safetensors").write_bytes(b"half")
            _full()

    with pytest.raises(DiskFullError, match=r"No space left for (checkpoint step_2|LATEST) at .*: needs about "
                                            r"[\d.,]+ (B|KiB|MiB), [\d.,]+ \S+ free") as err:
        save_step(root, 2, payload, _optimizer(), {"data": {}})
    assert str(root) in str(err.value)
    monkeypatch.undo()
    assert _snapshot(root) == before  # LATEST still names step_1, whose files are as written; no temp dir
    assert latest_step_dir(root).name == "step_1"
    assert not list(root.glob(".step_*")) and not list(root.glob(".LATEST.*"))


def test_a_step_that_cannot_fit_is_refused_before_any_byte_is_written(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    save_step(root, 1, _payload, None, {})
    size = sum(len(b) for b in _snapshot(root / "step_1").values())
    before = _snapshot(root)
    monkeypatch.setattr(diskspace, "free_bytes", lambda path: diskspace.HEADROOM_BYTES + size // 2)
    written = []
    with pytest.raises(DiskFullError, match=rf"checkpoint step_2 at {root}: needs about"):
        save_step(root, 2, lambda d: written.append(d), None, {}, needed=10)  # the last step's size stands for it
    assert not written and _snapshot(root) == before


def test_a_killed_writes_temp_dir_is_swept_at_the_next_save_and_nothing_else_is_touched(tmp_path):
    root = tmp_path / "checkpoints"
    save_step(root, 2, _payload, None, {})
    partial = root / ".step_4.k1ll3d00"
    partial.mkdir()
    (partial / "rng.pt").write_bytes(b"half a file")
    keep = root / "notes.txt"
    keep.write_text("mine")
    assert sweep_partial_steps(root) == [partial]
    partial.mkdir()
    save_step(root, 4, _payload, None, {})
    assert not partial.exists() and keep.read_text() == "mine"
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "notes.txt", "step_2", "step_4"]


def test_a_latest_holding_binary_is_refused_naming_the_file(tmp_path):
    root = tmp_path / "checkpoints"
    save_step(root, 1, _payload, None, {})
    (root / "LATEST").write_bytes(b"\xff\xfe\x00\x9c")
    with pytest.raises(CheckpointIntegrityError, match=rf"{root / 'LATEST'} is not a step name \(it holds binary"):
        latest_step_dir(root)


def test_rng_pt_restores_the_torch_python_and_numpy_generators(tmp_path):
    root = tmp_path / "checkpoints"
    checkpoint.seed_all(7)
    step_dir = save_step(root, 1, _payload, None, {})
    want = (torch.rand(3), random.random(), np.random.rand(3))
    checkpoint.seed_all(8)  # every generator moves elsewhere
    load_step_state(step_dir, None)
    got = (torch.rand(3), random.random(), np.random.rand(3))
    assert torch.equal(want[0], got[0]) and want[1] == got[1] and np.array_equal(want[2], got[2])


def test_seed_all_makes_every_generator_depend_on_the_seed_alone():
    checkpoint.seed_all(3)
    first = (torch.rand(2), random.random(), np.random.rand(2))
    random.random(), np.random.rand(5), torch.rand(4)  # noqa: B018 - drawn, as a training step would
    checkpoint.seed_all(3)
    again = (torch.rand(2), random.random(), np.random.rand(2))
    assert torch.equal(first[0], again[0]) and first[1] == again[1] and np.array_equal(first[2], again[2])
