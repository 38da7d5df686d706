"""Installing stitch the way a user does: by name, from built wheels, into a venv that has nothing else.

The four distributions (stitch-lm, stitch-clip, stitch-qwen, stitch-nemotron) are built as sdists, then wheels
are built FROM those sdists (so an sdist that lacks its package fails here), into a local wheelhouse. A fresh
venv gets torch's CPU wheel from this machine's disk (any other torch spec pulls a CUDA build) and then
``pip install --find-links WHEELHOUSE <name>``: third-party dependencies from the index, stitch's own from the
wheelhouse.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTIONS = {"stitch-lm": ROOT, **{name: ROOT / "plugins" / name
                                        for name in ("stitch-clip", "stitch-qwen", "stitch-nemotron")}}
pytestmark = pytest.mark.slow


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {result.returncode}:\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-3000:]}")
    return result


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheelhouse")
    sdists = out / "sdist"
    for source in DISTRIBUTIONS.values():
        _run([sys.executable, "-m", "build", "--sdist", "--outdir", str(sdists), str(source)])
    wheels = out / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels),
          *map(str, sorted(sdists.glob("*.tar.gz")))])
    return wheels


@pytest.fixture(scope="module")
def user_venv(tmp_path_factory) -> Path:
    """A venv with nothing but pip and torch's CPU wheel (from this machine's disk)."""
    path = tmp_path_factory.mktemp("user-venv")
    venv.create(path, with_pip=True, clear=True)
    _run([str(path / "bin" / "pip"), "install", "-q", f"torch=={_torch_version()}"])
    return path


def _torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]


def _stitch(env_dir: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}
    return _run([str(env_dir / "bin" / "stitch"), *args], cwd=cwd, env=env)


def _pip_names(env_dir: Path) -> set[str]:
    listed = json.loads(_run([str(env_dir / "bin" / "pip"), "list", "--format", "json"]).stdout)
    return {p["name"].lower() for p in listed}


def test_wheels_and_sdists_of_all_four_distributions_build_and_each_wheel_holds_its_package(wheelhouse):
    import zipfile

    built = {p.name.split("-")[0]: p for p in wheelhouse.glob("*.whl")}
    assert set(built) == {"stitch_lm", "stitch_clip", "stitch_qwen", "stitch_nemotron"}
    for dist, wheel in built.items():
        package = "stitch" if dist == "stitch_lm" else dist
        names = zipfile.ZipFile(wheel).namelist()
        assert f"{package}/__init__.py" in names, f"{wheel.name} lacks {package}/__init__.py"
    assert "stitch/templates/stitch-plugin/cookiecutter.json" in zipfile.ZipFile(built["stitch_lm"]).namelist()


def test_pip_install_stitch_qwen_by_name_brings_the_core_and_no_unrelated_stitch(wheelhouse, user_venv):
    _run([str(user_venv / "bin" / "pip"), "install", "-q", "--find-links", str(wheelhouse), "stitch-qwen"])
    names = _pip_names(user_venv)
    assert {"stitch-lm", "stitch-qwen"} <= names
    assert "stitch" not in names, "the unrelated `stitch` project from the index was installed"
    listed = json.loads(_stitch(user_venv, "list-plugins", "--json").stdout)
    assert [p["name"] for p in listed["plugins"]] == ["stitch-qwen"]
    assert listed["failed"] == []
    everything = json.loads(_stitch(user_venv, "list-plugins", "--json", "--all").stdout)
    assert sorted(p["name"] for p in everything["plugins"]) == ["stitch-lm", "stitch-qwen"]


def test_adding_stitch_clip_by_name_runs_a_two_step_alignment_on_a_tiny_preset(wheelhouse, user_venv, tmp_path):
    _run([str(user_venv / "bin" / "pip"), "install", "-q", "--find-links", str(wheelhouse), "stitch-qwen",
          "stitch-clip"])
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(textwrap.dedent("""\
        name: tiny-install
        model: qwen3.5-tiny
        encoder: clip-tiny
        task: counting
        data:
          source: {builtin: counting-shapes, rows: 24, seed: 0}
          columns: {id: id, media: image, question: question, answer: answer}
          partitions: {alignment: [0, 24]}
          scan_cap: 32
          budgets: {transient_mib: 256, retained_mib: 16}
        stages:
          alignment: {partition: alignment, eval_partition: null, steps: 2, batch_size: 2, token_budget: 256}
        """))
    run = tmp_path / "run"
    _stitch(user_venv, "prepare", "--recipe", str(recipe), "--out", str(run / "data"))
    _stitch(user_venv, "train", "alignment", "--recipe", str(recipe), "--out", str(run))
    metrics = [json.loads(line) for line in (run / "alignment" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]
    assert (run / "alignment" / "checkpoints" / "LATEST").read_text().strip() == "step_2"


def test_a_plugin_from_stitch_new_plugin_installs_with_its_dependencies_and_is_listed(wheelhouse, user_venv,
                                                                                    tmp_path):
    pip = str(user_venv / "bin" / "pip")
    _run([pip, "install", "-q", "--find-links", str(wheelhouse), "stitch-lm[scaffold]"])
    _stitch(user_venv, "new-plugin", "spectrum", "--out", str(tmp_path))
    project = tmp_path / "stitch-spectrum"
    assert (project / "pyproject.toml").is_file()
    _run([pip, "install", "-q", "--find-links", str(wheelhouse), str(project)])  # dependencies resolved, no --no-deps
    listed = json.loads(_stitch(user_venv, "list-plugins", "--json").stdout)
    assert "stitch-spectrum" in [p["name"] for p in listed["plugins"]]
    assert "stitch" not in _pip_names(user_venv)
