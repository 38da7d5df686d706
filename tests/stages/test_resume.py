"""GRPO and DPO through the one stage loop: SIGKILL mid-run and ``--resume`` reproduce an uninterrupted run
bitwise with the default intra-op threads; the shared options (grad_clip, cosine schedule) are honoured; every
checkpoint records the recipe digest, the resolved recipe's run layout and the RNG of every CUDA device."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stitch.config.recipe import load_recipe
from stitch.host.host import get_host
from stitch.stages.loop import run_stage
from tests.stitch_testing import cli, copy_prepared, kill_after_checkpoint, write_recipe

# hot sampling over groups of 4: some group has mixed rewards, so GRPO's first update is not zero
GRPO_MOVING = {"stages__grpo__prompts_per_step": 4, "stages__grpo__group_size": 4, "stages__grpo__temperature": 1.5,
               "stages__grpo__lr_adapter": 1e-2}


def _records(run: Path, stage: str) -> list[dict]:
    """Every metrics line without its wall-clock fields (seconds and rates differ between any two runs)."""
    lines = (run / stage / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not (k.endswith("_s") or k == "tokens_per_s")}
            for line in lines]


def _step_dir(run: Path, stage: str, step: int) -> Path:
    return run / stage / "checkpoints" / f"step_{step}"


@pytest.mark.parametrize("stage", ["grpo", "dpo"])
def test_killed_midway_resumes_to_identical_metrics_and_adapter(sft_run, tmp_path, stage):
    env = dict(os.environ)  # default intra-op threads: resume is bitwise without pinning one thread
    extra = GRPO_MOVING if stage == "grpo" else {"stages__dpo__lr_adapter": 2e-3}
    recipe = write_recipe(tmp_path / "r.yaml", **{f"stages__{stage}__steps": 8, f"stages__{stage}__save_every": 3},
                          **extra)
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    for run in (straight, killed):
        shutil.copytree(sft_run, run)
    train = ("train", stage, "--recipe", str(recipe), "--out")
    subprocess.run(cli(*train, str(straight)), check=True, capture_output=True, env=env)
    kill_after_checkpoint(cli(*train, str(killed)), killed / stage / "checkpoints", 3, env)
    assert not _step_dir(killed, stage, 6).exists(), "killed too late to test a resume"
    assert len(_records(killed, stage)) < 8
    subprocess.run(cli(*train, str(killed), "--resume"), check=True, capture_output=True, env=env)

    want, got = _records(straight, stage), _records(killed, stage)
    assert [r["step"] for r in got] == list(range(1, 9))
    assert got == want  # every logged float (loss, reward or margin, kl, grad_norm, lr) bitwise
    assert len({r["loss"] for r in want}) > 1  # the run moved: equal curves are not both constant
    a = load_file(str(_step_dir(straight, stage, 8) / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(_step_dir(killed, stage, 8) / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    donor = load_file(str(sft_run / "sft" / "checkpoints" / "step_4" / "adapter" / "adapter_model.safetensors"))
    assert any(not torch.equal(a[k], donor[k]) for k in a)  # and the adapter trained


def _first_moment_norm(step_dir: Path) -> float:
    """||AdamW exp_avg|| after one step: 0.1 x the norm of the gradient the optimizer applied (after clipping)."""
    state = torch.load(step_dir / "optimizer.pt", weights_only=True)["state"]
    return math.sqrt(sum(float(s["exp_avg"].double().pow(2).sum()) for s in state.values()))


@pytest.mark.parametrize("stage", ["grpo", "dpo"])
def test_grad_clip_bounds_the_applied_gradient_and_null_turns_clipping_off(sft_run, tmp_path, stage):
    extra = GRPO_MOVING if stage == "grpo" else {}
    applied, logged = {}, {}
    for clip in (None, 1e-4):
        run = tmp_path / f"clip{clip}"
        shutil.copytree(sft_run, run)
        recipe = load_recipe(write_recipe(tmp_path / f"r{clip}.yaml", **{f"stages__{stage}__steps": 1,
                                                                           f"stages__{stage}__grad_clip": clip},
                                          **extra))
        run_stage(recipe, stage, run, progress=False, registry=get_host())
        logged[clip] = _records(run, stage)[0]["grad_norm"]
        applied[clip] = _first_moment_norm(_step_dir(run, stage, 1))
    assert logged[None] == logged[1e-4] > 1e-3  # the same first gradient, logged before clipping
    assert applied[None] == pytest.approx(0.1 * logged[None], rel=1e-3)  # null: applied whole
    assert applied[1e-4] == pytest.approx(0.1 * 1e-4, rel=1e-3)  # clipped to grad_clip


@pytest.mark.parametrize("stage", ["grpo", "dpo"])
def test_cosine_schedule_decays_the_logged_and_applied_learning_rate(sft_run, tmp_path, stage):
    run = tmp_path / "run"
    shutil.copytree(sft_run, run)
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", **{f"stages__{stage}__steps": 3,
                                                              f"stages__{stage}__schedule": "cosine",
                                                              f"stages__{stage}__lr_adapter": 1e-3}))
    run_stage(recipe, stage, run, progress=False, registry=get_host())
    lrs = [r["lr_adapter"] for r in _records(run, stage)]
    assert lrs == pytest.approx([1e-3, 1e-3 * 0.75, 1e-3 * 0.25])  # 0.5 (1 + cos(pi t / 3)), t = 0, 1, 2
    optimizer = torch.load(_step_dir(run, stage, 3) / "optimizer.pt", weights_only=True)
    assert optimizer["param_groups"][0]["lr"] == pytest.approx(0.0, abs=1e-12)  # the optimizer follows it


class _Resolved:
    """A recipe that carries its resolved YAML (as typed recipes do): every other attribute is the recipe's."""

    def __init__(self, recipe, text: str) -> None:
        self._recipe, self.resolved_yaml = recipe, text

    def __getattr__(self, name: str):
        return getattr(self._recipe, name)


@pytest.mark.parametrize("stage", ["grpo", "dpo"])
def test_checkpoint_records_the_recipe_digest_and_warm_start_and_the_run_keeps_the_resolved_recipe(
        sft_run, tmp_path, stage):
    run = tmp_path / "run"
    shutil.copytree(sft_run, run)
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", **{f"stages__{stage}__steps": 1}))
    summary = run_stage(_Resolved(recipe, "resolved: yes\n"), stage, run, progress=False, registry=get_host())
    state = json.loads((_step_dir(run, stage, 1) / "trainer_state.json").read_text())
    assert recipe.digest and state["recipe_digest"] == recipe.digest
    assert state["warm_start"] == summary["donor"] == str((run / "sft" / "checkpoints" / "step_4").resolve())
    assert (run / "recipe.yaml").read_text() == "resolved: yes\n"


def test_checkpoint_saves_and_restores_the_rng_of_every_cuda_device(tmp_path, monkeypatch):
    # no GPU here: torch.cuda's generator functions are replaced by two devices' worth of state that the test owns
    from stitch.runs.checkpoint import load_step_state, save_step

    devices = [torch.arange(16, dtype=torch.uint8), torch.arange(16, 32, dtype=torch.uint8)]

    def set_all(states) -> None:
        for i, state in enumerate(states):
            devices[i] = state.clone()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(devices))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [d.clone() for d in devices])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_all)
    step_dir = save_step(tmp_path / "checkpoints", 1, lambda d: None, None, {})
    saved = [d.clone() for d in devices]
    devices[:] = [torch.zeros(16, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8)]  # the generators moved on
    load_step_state(step_dir, None)
    assert all(torch.equal(a, b) for a, b in zip(devices, saved, strict=True))
    assert len(torch.load(step_dir / "rng.pt", weights_only=True)["cuda"]) == 2


def test_a_resume_under_another_thread_count_continues_bitwise_with_the_checkpoints_count(prepared, tmp_path):
    # CPU reductions split by thread count: a resumed process with another count drifted ~1e-7 from step 5 on,
    # until checkpoints recorded the count and resume adopted it
    # both counts are set explicitly: the pytest process's own count may have been changed by earlier tests
    first, other = "2", "1"
    env = {**os.environ, "OMP_NUM_THREADS": first}
    recipe = write_recipe(tmp_path / "r.yaml", stages__sft__steps=6, stages__sft__save_every=3)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for run in (straight, resumed):
        copy_prepared(prepared / "run", run)
        shutil.copytree(prepared / "run" / "alignment", run / "alignment")
    train = ("train", "sft", "--recipe", str(recipe), "--out")
    subprocess.run(cli(*train, str(straight)), check=True, capture_output=True, env=env)
    subprocess.run(cli(*train, str(resumed), "--max-steps", "3"), check=True, capture_output=True, env=env)
    state = json.loads((_step_dir(resumed, "sft", 3) / "trainer_state.json").read_text())
    assert state["intra_op_threads"] == int(first) != int(other)
    subprocess.run(cli(*train, str(resumed), "--resume"), check=True, capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": other})
    assert [r["loss"] for r in _records(resumed, "sft")] == [r["loss"] for r in _records(straight, "sft")]
    for part in ("adapter/adapter_model.safetensors", "projector/mm-projector.safetensors"):
        a, b = (load_file(str(_step_dir(run, "sft", 6) / part)) for run in (straight, resumed))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part


def test_an_in_process_resume_runs_with_the_checkpoints_threads_and_gives_the_callers_count_back(
        prepared, tmp_path, caplog):
    # stitch.api callers and pytest run several stages in one process: a resumed stage's thread count must not
    # outlive it, or the next stage in the process runs with another count than a fresh process would
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", stages__sft__steps=2, stages__sft__save_every=1))
    run = tmp_path / "run"
    copy_prepared(prepared / "run", run)
    shutil.copytree(prepared / "run" / "alignment", run / "alignment")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        run_stage(recipe, "sft", run, max_steps=1, progress=False, registry=get_host())
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        with caplog.at_level("INFO", logger="stitch"):
            run_stage(recipe, "sft", run, resume=True, progress=False, registry=get_host())
        assert "with 1 intra-op threads, as it was written (this process had 2)" in caplog.text
        assert json.loads((_step_dir(run, "sft", 2) / "trainer_state.json").read_text())["intra_op_threads"] == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
