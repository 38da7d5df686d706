"""Whole conversation histories through rollout, inference and `stitch infer`; DPO warm-started from GRPO; the chain
evaluating the last stage it ran."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from stitch.config.recipe import RecipeError, load_recipe
from stitch.data.collator import tokenize_example
from stitch.demo.data import render_scene, sample_scene
from stitch.host.host import get_host
from stitch.stages.chain import final_stage
from stitch.stages.loop import run_stage
from tests.stitch_testing import write_recipe

HISTORY = [
    {"role": "user", "content": "Here are two scenes: <image> and <image>. How many objects are in the first?"},
    {"role": "assistant", "content": "The answer is 2."},
    {"role": "user", "content": "And in the second?"},
]


def _images(tmp_path: Path) -> list[str]:
    paths = []
    for seed in (1, 2):
        path = tmp_path / f"scene{seed}.png"
        render_scene(sample_scene(random.Random(seed))).save(path)
        paths.append(str(path))
    return paths


def test_infer_rollout_and_training_see_byte_identical_prompts_for_a_three_turn_two_image_row(
        sft_run, tmp_path, monkeypatch):
    import stitch.serve.inference as inference
    from stitch.serve.inference import Stitched
    from stitch.stages.session import StitchSession

    seen: list[list[int]] = []
    real = inference.prompt_embeddings

    def spy(payload, model, prompts, zero_features=False):
        seen.extend(ids for _, ids, _ in prompts)
        return real(payload, model, prompts, zero_features)

    monkeypatch.setattr(inference, "prompt_embeddings", spy)
    session = StitchSession.open(load_recipe(write_recipe(tmp_path / "r.yaml")), sft_run, registry=get_host())
    server = Stitched(sft_run / "sft" / "checkpoints", registry=get_host())
    server.answer(_images(tmp_path), HISTORY, max_new_tokens=2)
    rollout = session.prompt_ids(HISTORY, 2)  # what GRPO and evaluation render from a row's prompt_messages
    training, _ = tokenize_example(session.tokenizer, [*HISTORY, {"role": "assistant", "content": "3"}],
                                   session.sentinel_ids, session.encoder_spec.tokens_per_item, 2, turns="all")
    assert seen == [rollout]
    assert training[: len(rollout)] == rollout
    assert session.tokenizer.decode(rollout).count("<|im_start|>user") == 2  # the whole history, not the last turn


def test_infer_cli_reads_a_history_with_several_images_per_row(sft_run, tmp_path):
    import subprocess
    import sys

    images = _images(tmp_path)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "h0", "images": [Path(p).name for p in images], "messages": HISTORY}) + "\n")
    out = subprocess.run([sys.executable, "-m", "stitch", "infer", "--adapter", str(sft_run / "sft" / "checkpoints"),
                          "--input", str(rows), "--max-new-tokens", "2"], capture_output=True, text=True, check=True)
    (answer,) = [json.loads(line) for line in out.stdout.splitlines()]
    assert answer["id"] == "h0" and isinstance(answer["answer"], str)
    assert answer["images"] == [Path(p).name for p in images]  # the row comes back as given, plus the answer


def test_dpo_warm_started_from_grpo_takes_grpos_latest_checkpoint(sft_run, tmp_path):
    shutil.copytree(sft_run, tmp_path / "run")
    run = tmp_path / "run"
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", stages__grpo__steps=1, stages__dpo__steps=1,
                                      stages__dpo__warm_start="grpo"))
    grpo = run_stage(recipe, "grpo", run, progress=False, registry=get_host())
    dpo = run_stage(recipe, "dpo", run, progress=False, registry=get_host())
    assert dpo["donor"] == grpo["checkpoint"]


def test_dpo_warm_start_from_an_undeclared_stage_is_refused(tmp_path):
    path = write_recipe(tmp_path / "r.yaml", stages__dpo__warm_start="grpo")
    with pytest.raises(RecipeError, match=r"stages\.dpo\.warm_start"):
        load_recipe(path, overrides=["stages.grpo=null"])


def test_the_chain_evaluates_the_last_stage_it_ran():
    assert final_stage({"prepare": {}, "alignment": {}, "sft": {}, "grpo": {}, "dpo": {}}) == "dpo"
    assert final_stage({"prepare": {}, "alignment": {}, "sft": {}, "grpo": {}}) == "grpo"
    assert final_stage({"prepare": {}, "alignment": {}}) is None


@pytest.mark.parametrize("turns", ["all", "last"])
def test_sft_on_multi_turn_two_image_rows_learns_the_turns_it_is_told(tmp_path, turns):
    """The OpenAI-format fixture (a two-image interleaved row, a two-turn row) through prepare, alignment and SFT:
    one unpacked step over both rows puts loss on exactly the labels ``train_turns`` selects."""
    import yaml

    from stitch.stages.session import StitchSession
    from tests.stitch_testing import prepare_resolved

    shutil.copytree(Path(__file__).parents[1] / "data" / "fixtures" / "formats", tmp_path / "data")
    step = {"partition": "train", "eval_partition": None, "steps": 1, "batch_size": 2, "packing": False,
            "save_every": 1}
    recipe_path = tmp_path / "r.yaml"
    recipe_path.write_text(yaml.safe_dump({
        "name": "history", "model": "qwen3.5-tiny", "encoder": "clip-tiny", "data": {
            "source": {"path": "data/openai.jsonl", "format": "json"},
            "columns": {"id": "id", "media": "images", "messages": "messages"}, "partitions": {"train": [0, 2]},
            "scan_cap": 8, "budgets": {"transient_mib": 64, "retained_mib": 16}, "on_corrupt": "skip",
            "prepare": {"workers": 0}},
        "stages": {"alignment": step, "sft": {**step, "train_turns": turns}}}))
    recipe = load_recipe(recipe_path)
    run = tmp_path / "run"
    prepare_resolved(recipe, run / "data", progress=False)
    run_stage(recipe, "alignment", run, progress=False, registry=get_host())
    run_stage(recipe, "sft", run, progress=False, registry=get_host())
    (metrics,) = [json.loads(line) for line in (run / "sft" / "metrics.jsonl").read_text().splitlines()]
    session = StitchSession.open(recipe, run, registry=get_host())
    expected = sum(sum(label != -100 for label in session.make_sample(row.as_json(), turns=turns).labels)
                   for row in session.data.rows("train"))
    last_only = sum(sum(label != -100 for label in session.make_sample(row.as_json()).labels)
                    for row in session.data.rows("train"))
    assert metrics["label_tokens"] == expected
    assert (expected > last_only) == (turns == "all")
