"""A resume against a changed recipe or changed prepared data is refused, naming the fields or the manifest."""

from __future__ import annotations

import json

import pytest

from stitch.runs.resume import RECIPE_NAME, ResumeMismatchError, changed_fields, check_resumable, data_digest

BEFORE = "name: r\nstages:\n  sft:\n    steps: 6\n    lr_adapter: 0.003\n"
AFTER = "name: r\nstages:\n  sft:\n    steps: 6\n    lr_adapter: 0.001\n    seed: 1\n"


def _step(tmp_path, manifest_text: str = "row\n"):
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text(manifest_text)
    step = tmp_path / "step_2"
    step.mkdir()
    (step / RECIPE_NAME).write_text(BEFORE)
    (step / "trainer_state.json").write_text(json.dumps({"recipe_digest": "old", "data_digest": data_digest(manifest)}))
    return step, manifest


def test_changed_fields_names_each_dotted_field_with_old_and_new():
    assert changed_fields(BEFORE, AFTER) == ["stages.sft.lr_adapter: 0.003 -> 0.001",
                                             "stages.sft.seed: '(absent)' -> 1"]


def test_a_changed_recipe_is_refused_naming_the_field(tmp_path):
    step, manifest = _step(tmp_path)
    with pytest.raises(ResumeMismatchError, match=r"the recipe changed since that checkpoint \(stages\.sft\.lr_adapter: "
                                                  r"0\.003 -> 0\.001"):
        check_resumable(step, AFTER, "new", manifest)
    check_resumable(step, BEFORE, "old", manifest)  # the same recipe resumes


def test_changed_data_is_refused_naming_the_manifest(tmp_path):
    step, manifest = _step(tmp_path)
    manifest.write_text("another row\n")
    with pytest.raises(ResumeMismatchError, match=rf"the prepared data changed since that checkpoint \({manifest} "):
        check_resumable(step, BEFORE, "old", manifest)
