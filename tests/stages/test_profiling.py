"""``profile_steps``: the named steps run under torch.profiler, its trace and operator table land beside the
stage's metrics, summary.json names the top operators, and the training itself is unchanged."""

from __future__ import annotations

import json
import shutil

import pytest

from stitch.config.recipe import RecipeError, load_recipe
from stitch.host.host import get_host
from stitch.stages.loop import run_stage
from tests.stitch_testing import copy_prepared, write_recipe


def _sft(prepared, tmp_path, name, **overrides):
    run = tmp_path / name
    copy_prepared(prepared / "run", run)
    shutil.copytree(prepared / "run" / "alignment", run / "alignment")
    recipe = load_recipe(write_recipe(tmp_path / f"{name}.yaml", stages__sft__steps=3, stages__sft__save_every=3,
                                      stages__sft__eval_partition=None, **overrides))
    summary = run_stage(recipe, "sft", run, progress=False, registry=get_host())
    losses = [r["loss"] for r in map(json.loads, (run / "sft" / "metrics.jsonl").read_text().splitlines())
              if "loss" in r]
    return run, summary, losses


def test_profiled_steps_write_a_trace_and_an_operator_table_and_leave_the_losses_unchanged(prepared, tmp_path):
    run, summary, losses = _sft(prepared, tmp_path, "profiled", stages__sft__profile_steps=[2, 3])
    profile = summary["profile"]
    assert profile["steps"] == [2, 3]
    trace = json.loads((run / "sft" / "profile" / "trace.json").read_text())
    assert any(e.get("name", "").startswith("aten::mm") for e in trace["traceEvents"])
    assert "aten::" in (run / "sft" / "profile" / "ops.txt").read_text()
    assert profile["top"] and all(op["self_ms"] >= 0 and op["calls"] > 0 for op in profile["top"])
    assert [op["self_ms"] for op in profile["top"]] == sorted((op["self_ms"] for op in profile["top"]), reverse=True)
    _, plain, plain_losses = _sft(prepared, tmp_path, "plain")
    assert "profile" not in plain and not (tmp_path / "plain" / "sft" / "profile").exists()
    assert losses == plain_losses


@pytest.mark.parametrize("steps", [[3, 2], [2, 9]])
def test_profile_steps_outside_the_stage_are_refused_at_load_naming_the_field(tmp_path, steps):
    with pytest.raises(RecipeError, match=r"stages\.sft\.profile_steps"):
        load_recipe(write_recipe(tmp_path / "r.yaml", stages__sft__steps=4, stages__sft__profile_steps=steps))
