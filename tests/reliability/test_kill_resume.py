"""kill -9 at a random step (a torn metrics line) and mid-checkpoint-write (a half-written temp dir), for
alignment, SFT, GRPO and DPO, and of `stitch run` between stages: every resumed run's checkpoint directory equals
the uninterrupted run's file by file, byte for byte (rng.pt included), and no temp dir is left."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stitch.config.recipe import load_recipe
from stitch.host.host import get_host
from stitch.runs.resume import ResumeMismatchError
from stitch.stages.loop import run_stage
from tests.stitch_testing import cli, write_recipe

STEPS, SAVE_EVERY = 6, 2


def faulty(fault: str, *args: str) -> list[str]:
    """``stitch ARGS`` launched through tests.reliability.faults, which SIGKILLs itself at ``fault``."""
    return [sys.executable, "-m", "tests.reliability.faults", fault, *args]


def killed(args: list[str]) -> None:
    res = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert res.returncode == -9, f"expected SIGKILL, got rc {res.returncode}: {res.stderr[-2000:]}"


def ok(args: list[str]) -> None:
    res = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by relative path, with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def metric_records(path: Path) -> list[dict]:
    """The metrics lines without their wall-clock fields (seconds and rates differ between any two runs)."""
    return [{k: v for k, v in json.loads(line).items() if not (k.endswith("_s") or k == "tokens_per_s")}
            for line in path.read_text().splitlines()]


def assert_same_checkpoints(straight: Path, resumed: Path) -> int:
    """The two checkpoint directories hold the same files with the same bytes; returns how many files."""
    want, got = tree_bytes(straight), tree_bytes(resumed)
    assert sorted(got) == sorted(want)
    differ = [name for name in want if want[name] != got[name]]
    assert not differ, f"files differ after the resume: {differ}"
    assert not list(resumed.glob(".step_*")), "a killed checkpoint write's temp dir was left"
    return len(want)


def _donor(stage: str, request: pytest.FixtureRequest, into: Path) -> None:
    """The run directory a stage starts from: prepared data, plus the stages it warm-starts from (the SFT donor is
    built only for the stages that need it)."""
    prepared = request.getfixturevalue("prepared")
    if stage == "alignment":
        shutil.copytree(prepared / "run" / "data", into / "data")
    elif stage == "sft":
        shutil.copytree(prepared / "run", into)
    else:
        shutil.copytree(request.getfixturevalue("sft_run"), into)
    shutil.rmtree(into / stage, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["alignment", "sft", "grpo", "dpo"])
def test_kill_at_a_random_step_and_mid_checkpoint_write_resumes_to_byte_identical_checkpoints(
        stage, request, tmp_path):
    steps = {f"stages__{stage}__steps": STEPS, f"stages__{stage}__save_every": SAVE_EVERY}
    moving = {"stages__grpo__temperature": 1.5, "stages__grpo__lr_adapter": 1e-2} if stage == "grpo" else {}
    recipe = write_recipe(tmp_path / "r.yaml", **steps, **moving)
    run, straight = tmp_path / "run", tmp_path / "straight"
    train = ("train", stage, "--recipe", str(recipe), "--out", str(run))
    # the uninterrupted run, at the same path as the killed one (paths recorded in checkpoints are then equal)
    _donor(stage, request, run)
    ok(cli(*train))
    run.rename(straight)
    _donor(stage, request, run)

    kill_step = random.Random(f"kill-{stage}").choice(range(1, STEPS, SAVE_EVERY)[1:])  # 3 or 5: past a checkpoint
    killed(faulty(f"step:{kill_step}", *train))  # half of that step's metrics line is written, then kill -9
    assert (run / stage / "checkpoints" / "LATEST").read_text().strip() == f"step_{kill_step - 1}"
    # resumed (the torn line dropped), then killed again while writing the next checkpoint
    killed(faulty(f"write:{kill_step + 1}", *train, "--resume"))
    assert list((run / stage / "checkpoints").glob(f".step_{kill_step + 1}.*")), "the kill missed the write"
    ok(cli(*train, "--resume"))

    files = assert_same_checkpoints(straight / stage / "checkpoints", run / stage / "checkpoints")
    assert files >= 8
    assert metric_records(run / stage / "metrics.jsonl") == metric_records(straight / stage / "metrics.jsonl")


@pytest.mark.slow
def test_stitch_run_killed_between_stages_resumes_to_byte_identical_checkpoints(prepared, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml")
    run, straight = tmp_path / "run", tmp_path / "straight"
    chain = ("run", str(recipe), "--out", str(run))
    shutil.copytree(prepared / "run" / "data", run / "data")  # its shards are reused: prepare encodes nothing
    ok(cli(*chain))
    run.rename(straight)
    shutil.copytree(prepared / "run" / "data", run / "data")
    killed(faulty("summary:alignment", *chain))
    assert (run / "alignment" / "summary.json").is_file() and not (run / "sft").exists()
    ok(cli(*chain))  # alignment is skipped (its summary exists); sft and grpo run
    for stage in ("alignment", "sft", "grpo"):
        assert_same_checkpoints(straight / stage / "checkpoints", run / stage / "checkpoints")


def test_resume_after_the_recipe_or_the_data_changed_is_refused_naming_what_changed(prepared, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(prepared / "run", run)
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", stages__sft__steps=4))
    run_stage(recipe, "sft", run, max_steps=2, progress=False, registry=get_host())
    changed = load_recipe(write_recipe(tmp_path / "c.yaml", stages__sft__steps=4, stages__sft__lr_adapter=1e-4))
    with pytest.raises(ResumeMismatchError, match=r"the recipe changed since that checkpoint \(stages\.sft\.lr_adapter: "
                                                  r"0\.003 -> 0\.0001\)"):
        run_stage(changed, "sft", run, resume=True, progress=False, registry=get_host())
    manifest = run / "data" / "manifest.jsonl"
    lines = manifest.read_text().splitlines(keepends=True)
    manifest.write_text("".join(lines[1:] + lines[:1]))  # the same rows in another order: other data to resume on
    with pytest.raises(ResumeMismatchError, match=rf"the prepared data changed since that checkpoint \({manifest} "):
        run_stage(recipe, "sft", run, resume=True, progress=False, registry=get_host())
