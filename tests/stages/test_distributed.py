"""FSDP2 data parallel under torchrun (2 CPU processes, gloo): the loss curve of the same global batch matches a
one-process run, checkpoints resume across world sizes; impossible parallel layouts are refused at load with
the arithmetic."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stitch.config.recipe import RecipeError, load_recipe
from stitch.config.validate import check_launch
from stitch.host.host import get_host
from stitch.host.validate import validate_recipe
from stitch.stages.loop import run_stage, stage_options
from tests.stitch_testing import copy_prepared, write_recipe

REL = 1e-5  # one process vs two on the same global batch: fp32 summation order only


def _metrics(run: Path, stage: str) -> list[dict]:
    lines = (run / stage / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def _assert_losses_match(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want, strict=True):
        assert a["label_tokens"] == b["label_tokens"] and a["tokens"] == b["tokens"], (a, b)
        assert abs(a["loss"] - b["loss"]) <= REL * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * abs(b["grad_norm"]), (a["step"], a, b)


def _torchrun(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _with_alignment(prepared: Path, run: Path) -> Path:
    copy_prepared(prepared / "run", run)
    shutil.copytree(prepared / "run" / "alignment" / "checkpoints", run / "alignment" / "checkpoints")
    return run


# Launched by torchrun: alignment from scratch (the `prepared` fixture's recipe and data), then the first two
# SFT steps; the CLI path (`-m stitch train`) is the second launch below.
SCRIPT = """
import sys
from pathlib import Path
from stitch.config.recipe import load_recipe
from stitch.stages.loop import run_stage
from stitch.host.host import get_host

recipe = load_recipe(sys.argv[1])
run_stage(recipe, "alignment", Path(sys.argv[2]), progress=False, registry=get_host())
run_stage(recipe, "sft", Path(sys.argv[3]), max_steps=2, progress=False, registry=get_host())
"""


def test_two_processes_match_one_and_checkpoints_resume_across_world_sizes(prepared, tmp_path):
    recipe_path = write_recipe(tmp_path / "r.yaml", stages__sft__steps=4, stages__sft__batch_size=4,
                               stages__sft__save_every=2, stages__sft__eval_partition="eval",
                               stages__sft__eval_rows=4)
    recipe = load_recipe(recipe_path)

    # one process: the reference curve, 4 SFT steps (checkpoints at 2 and 4)
    ref = _with_alignment(prepared, tmp_path / "ref")
    run_stage(recipe, "sft", ref, progress=False, registry=get_host())
    want = _metrics(ref, "sft")

    # two processes, fresh: alignment (vs the fixture's one-process alignment), then SFT steps 1-2
    align2, sft2 = tmp_path / "align2", _with_alignment(prepared, tmp_path / "sft2")
    copy_prepared(prepared / "run", align2)
    (tmp_path / "launch.py").write_text(SCRIPT)
    _torchrun(str(tmp_path / "launch.py"), str(recipe_path), str(align2), str(sft2), cwd=tmp_path)
    _assert_losses_match(_metrics(align2, "alignment"), _metrics(prepared / "run", "alignment"))
    _assert_losses_match(_metrics(sft2, "sft"), want[:2])
    summary = json.loads((sft2 / "sft" / "summary.json").read_text())
    assert summary["world_size"] == 2 and len(summary["peak_memory_bytes_per_rank"]) == 2
    assert 0.0 <= summary["eval_accuracy"] <= 1.0  # generation ran with the sharded model gathered

    # the two-process checkpoint has the one-process layout: same files, keys, shapes, optimizer structure
    one, two = ref / "sft" / "checkpoints" / "step_2", sft2 / "sft" / "checkpoints" / "step_2"
    assert sorted(p.name for p in one.rglob("*")) == sorted(p.name for p in two.rglob("*"))
    for part in ("adapter/adapter_model.safetensors", "projector/mm-projector.safetensors"):
        a, b = load_file(str(one / part)), load_file(str(two / part))
        assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}, part
    opt1, opt2 = (torch.load(d / "optimizer.pt", weights_only=True) for d in (one, two))
    assert opt1["param_groups"] == opt2["param_groups"]
    assert {i: {k: v.shape for k, v in s.items()} for i, s in opt1["state"].items()} == {
        i: {k: v.shape for k, v in s.items()} for i, s in opt2["state"].items()
    }

    # 2 -> 1: the two-process step_2 resumes in one process and continues the reference curve
    run_stage(recipe, "sft", sft2, resume=True, progress=False, registry=get_host())
    _assert_losses_match(_metrics(sft2, "sft"), want)

    # 1 -> 2: the reference's step_2 resumes under torchrun through the CLI
    back = tmp_path / "back"
    shutil.copytree(ref, back)
    shutil.rmtree(back / "sft" / "checkpoints" / "step_4")
    (back / "sft" / "checkpoints" / "LATEST").write_text("step_2\n")
    _torchrun("-m", "stitch", "train", "sft", "--recipe", str(recipe_path), "--out", str(back), "--resume",
              cwd=tmp_path)
    _assert_losses_match(_metrics(back, "sft"), want)
    for run in (sft2, back):
        for part in ("adapter/adapter_model.safetensors", "projector/mm-projector.safetensors"):
            a = load_file(str(ref / "sft" / "checkpoints" / "step_4" / part))
            b = load_file(str(run / "sft" / "checkpoints" / "step_4" / part))
            assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5) for k in a), (run.name, part)


# -- parallel layout refused at load, with the arithmetic -----------------------------------------------


def _recipe(tmp_path: Path, **overrides):
    return load_recipe(write_recipe(tmp_path / "r.yaml", **overrides))


@pytest.mark.parametrize(
    ("parallel", "overrides", "message"),
    [
        ({"world_size": 2, "tensor_parallel": 4}, {},
         "parallel.tensor_parallel=4 does not divide world_size=2 (2 % 4 = 2)"),
        ({"world_size": 2, "expert_parallel": 3}, {},
         "parallel.expert_parallel=3 does not divide world_size=2 (2 % 3 = 2)"),
        ({"world_size": 2, "data_parallel": 4}, {},
         "parallel.data_parallel=4 x tensor_parallel=1 = 4 ranks, but world_size=2"),
        ({"world_size": 4}, {"stages__alignment__batch_size": 4, "stages__sft__batch_size": 6},
         "stages.sft.batch_size=6 packs is not divisible by data_parallel=4 (6 % 4 = 2)"),
        ({"world_size": 2, "gpus": {"policy": 1, "rollout": 1}, "rollout_replicas": 2}, {},
         "GRPO needs policy 1 + rollout 1 x 2 replicas = 3 GPUs, world_size is 2"),
        ({"world_size": 4, "rollout_replicas": 2}, {"stages__grpo__prompts_per_step": 3},
         "stages.grpo.prompts_per_step=3 prompts is not divisible by rollout_replicas=2 (3 % 2 = 1)"),
        ({"world_size": 2, "tensor_parallel": 2}, {},
         "parallel.tensor_parallel=2: tensor parallelism is not implemented for training in stitch yet"),
        ({"world_size": 2, "expert_parallel": 2}, {},
         "parallel.expert_parallel=2: expert parallelism is not implemented in stitch yet"),
    ],
    ids=["tp-does-not-divide", "ep-does-not-divide", "dp-times-tp-not-world", "batch-not-divisible",
         "grpo-roles-exceed-world", "prompts-not-divisible-by-replicas", "tp-not-implemented",
         "ep-not-implemented"],
)
def test_impossible_parallel_layout_is_refused_at_load_with_the_arithmetic(tmp_path, parallel, overrides, message):
    recipe = _recipe(tmp_path, parallel=parallel, **overrides)
    with pytest.raises(RecipeError) as err:
        validate_recipe(recipe, get_host())
    assert message in str(err.value)


def test_possible_parallel_layout_validates(tmp_path):
    recipe = _recipe(tmp_path, parallel={"world_size": 2, "data_parallel": 2, "gpus": {"policy": 1, "rollout": 1}})
    assert recipe.parallel.world_size == 2 and recipe.parallel.policy_gpus == 1
    validate_recipe(recipe, get_host())


def test_unknown_parallel_field_is_refused_naming_it(tmp_path):
    with pytest.raises(RecipeError, match=r"unknown field 'parallel\.tensor_paralel'"):
        _recipe(tmp_path, parallel={"world_size": 2, "tensor_paralel": 2})
    with pytest.raises(RecipeError, match=r"'parallel\.world_size': expected a positive integer, got 0"):
        _recipe(tmp_path, parallel={"world_size": 0})


def test_launch_whose_world_size_differs_from_the_recipe_is_refused_before_any_work(tmp_path):
    recipe = _recipe(tmp_path, parallel={"world_size": 2})
    # no prepared data under tmp_path/run: the refusal comes first
    with pytest.raises(RecipeError, match=r"parallel\.world_size=2, but this launch has WORLD_SIZE=1; start it "
                                          r"with `torchrun --nproc-per-node 2 -m stitch train sft"):
        run_stage(recipe, "sft", tmp_path / "run", progress=False, registry=get_host())


def test_launch_world_size_that_does_not_divide_the_batch_is_refused(tmp_path):
    recipe = _recipe(tmp_path)
    with pytest.raises(RecipeError, match=r"stages\.sft\.batch_size=2 packs is not divisible by WORLD_SIZE=4 "
                                          r"\(2 % 4 = 2\)"):
        check_launch(recipe, "sft", stage_options(recipe, "sft"), 4)
