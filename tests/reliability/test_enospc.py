"""ENOSPC injected at every write site of `prepare` (a feature shard, the manifest, the report) and of a training
stage (its metrics line, its checkpoint, LATEST: tests/runs/test_checkpoint_faults.py has each checkpoint file):
one ``DiskFullError`` naming the path, nothing partial left, and what an earlier run wrote untouched."""

from __future__ import annotations

import builtins
import errno
import shutil
from pathlib import Path

import pytest

import stitch.data.prepare as prepare_module
import stitch.data.prepare_report as report_module
from stitch.config.recipe import load_recipe
from stitch.host.host import get_host
from stitch.runs.diskspace import DiskFullError
from stitch.stages.loop import run_stage
from tests.stitch_testing import prepare_resolved, write_recipe

SMALL = {"data__source__rows": 16, "data__source__caption_rows": 2,
         "data__partitions": {"alignment": [0, 4], "train": [4, 8], "eval": [8, 12], "grpo": [12, 16]},
         "data__shard_rows": 4}


def _full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _shard(path: Path, features, metadata) -> str:
    path.with_name(".tmp-half").write_bytes(b"half")  # some bytes land before the disk fills
    _full()


def _manifest_open(real):
    def patched(file, mode="r", *args, **kwargs):
        handle = real(file, mode, *args, **kwargs)
        if "manifest" in Path(str(file)).name and "w" in mode:
            handle.write = _full
        return handle
    return patched


SITES = {
    "shard": lambda mp: mp.setattr(prepare_module, "write_shard", _shard),
    "manifest": lambda mp: mp.setattr(prepare_module, "open", _manifest_open(builtins.open), raising=False),
    "report": lambda mp: mp.setattr(report_module, "write_text_atomic", _full),
}


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def earlier(tmp_path_factory):
    """A complete preparation of the small recipe (seed 0): what a failed re-prepare must leave untouched."""
    root = tmp_path_factory.mktemp("earlier")
    prepare_resolved(load_recipe(write_recipe(root / "r.yaml", **SMALL)), root / "data", progress=False)
    return root / "data"


@pytest.mark.parametrize("site", list(SITES))
def test_enospc_at_each_prepare_write_site_leaves_a_fresh_directory_absent(tmp_path, monkeypatch, site):
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", **SMALL))
    SITES[site](monkeypatch)
    out = tmp_path / "data"
    with pytest.raises(DiskFullError, match=r"No space left for .* at .*: needs about") as err:
        prepare_resolved(recipe, out, progress=False)
    assert str(out) in str(err.value)
    assert not out.exists()


def test_enospc_while_re_preparing_leaves_the_earlier_preparation_byte_for_byte(earlier, tmp_path, monkeypatch):
    out = tmp_path / "data"
    shutil.copytree(earlier, out)
    before = _tree(out)
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", **SMALL, data__source__seed=1))  # other rows: new shards
    SITES["shard"](monkeypatch)
    with pytest.raises(DiskFullError, match=rf"No space left for feature shard \w+\.safetensors at {out}"):
        prepare_resolved(recipe, out, progress=False)
    assert _tree(out) == before


def test_enospc_on_a_metrics_line_names_the_file_and_leaves_the_last_checkpoint(earlier, tmp_path, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(earlier, run / "data")
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", **SMALL, stages__alignment__steps=3,
                                      stages__alignment__save_every=1))
    real = Path.open

    def open_(self, mode="r", *args, **kwargs):
        if self.name == "metrics.jsonl" and mode == "a" and (self.parent / "checkpoints" / "step_2").exists():
            _full()
        return real(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_)
    with pytest.raises(DiskFullError, match=rf"No space left for a metrics line of metrics.jsonl at "
                                            rf"{run / 'alignment' / 'metrics.jsonl'}"):
        run_stage(recipe, "alignment", run, progress=False, registry=get_host())
    checkpoints = run / "alignment" / "checkpoints"
    assert (checkpoints / "LATEST").read_text() == "step_2\n" and not list(checkpoints.glob(".step_*"))
