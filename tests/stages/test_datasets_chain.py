"""A recipe of three datasets through `stitch run` on CPU: captions for alignment, multi-turn instructions with two
interleaved images per row mixed with captions for SFT, counting prompts for GRPO. The report gives rows per
dataset, the mixture's realised shares and the images shared between datasets (encoded once); a SFT run killed
mid-mixture resumes to the same batches."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from stitch.data.feature_cache import PreparedData
from stitch.demo.data import make_rows
from tests.stitch_testing import cli, kill_after_checkpoint

pytest.importorskip("stitch_clip", reason="the tiny CLIP encoder comes from the stitch-clip plugin")

RECIPE = {
    "name": "three", "model": "qwen3.5-tiny", "encoder": "clip-tiny", "task": "counting",
    "data": {"budgets": {"transient_mib": 256, "retained_mib": 64}, "feature_dtype": "float16",
             "prepare": {"workers": 0}},
    "datasets": {
        # captions of scenes 0-7 of seed 0: the same images as the first counting rows below
        "captions": {"source": {"builtin": "counting-shapes", "rows": 8, "caption_rows": 8, "seed": 0},
                     "columns": {"id": "id", "media": "image", "question": "question", "answer": "answer"},
                     "rows": 8},
        "instruct": {"source": {"path": "instruct/rows.jsonl", "format": "json"},
                     "columns": {"id": "id", "media": "images", "messages": "messages"}, "rows": 6},
        "math": {"source": {"builtin": "counting-shapes", "rows": 16, "seed": 0},
                 "columns": {"id": "id", "media": "image", "question": "question", "answer": "answer"},
                 "partitions": {"train": [0, 12], "eval": [12, 16]}},
    },
    "stages": {
        "alignment": {"data": "captions", "eval_partition": None, "steps": 2, "batch_size": 2, "save_every": 2},
        "sft": {"data": {"instruct": 0.8, "captions": 0.2}, "eval_partition": None, "steps": 4, "batch_size": 2,
                "save_every": 2, "lr_projector": 1e-2},
        "grpo": {"data": "math.train", "eval_partition": "math.eval", "eval_rows": 4, "steps": 1,
                 "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4, "eval_max_new_tokens": 4,
                 "save_every": 1},
    },
}


def write_instructions(root: Path) -> None:
    """Six OpenAI-style two-turn rows, each comparing two pictures whose markers stand inside the first question;
    consecutive rows share a picture (7 distinct images for 12 references)."""
    (root / "images").mkdir(parents=True)
    scenes = make_rows(7, 0, seed=3)
    for scene in scenes:
        (root / "images" / scene["image"]["path"]).write_bytes(scene["image"]["bytes"])
    lines = []
    for i in range(6):
        a, b = scenes[i], scenes[i + 1]
        lines.append({"id": f"pair-{i}", "images": [f"images/{a['image']['path']}", f"images/{b['image']['path']}"],
                      "messages": [
                          {"role": "user", "content": [
                              {"type": "text", "text": "First picture: "}, {"type": "image"},
                              {"type": "text", "text": " second picture: "}, {"type": "image"},
                              {"type": "text", "text": " How many objects are in the first?"}]},
                          {"role": "assistant", "content": str(a["count"])},
                          {"role": "user", "content": "And in the second?"},
                          {"role": "assistant", "content": str(b["count"])}]})
    (root / "rows.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.fixture(scope="module")
def three_run(tmp_path_factory, stitch_cache):
    root = tmp_path_factory.mktemp("three")
    write_instructions(root / "instruct")
    recipe = root / "three.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE, sort_keys=False))
    done = subprocess.run(cli("run", str(recipe), "--out", str(root / "run")), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return recipe, root / "run", done.stdout


def test_three_datasets_run_through_stitch_run_with_rows_per_dataset_and_shared_images_encoded_once(three_run):
    _, run, stdout = three_run
    summary = json.loads((run / "summary.json").read_text())
    prepared = summary["stages"]["prepare"]
    assert {name: d["rows"] for name, d in prepared["datasets"].items()} == {
        "captions": {"captions": 8}, "instruct": {"instruct": 6}, "math": {"math.train": 12, "math.eval": 4}}
    # 8 + 12 + 16 references; captions 0-7 are math rows 0-7, and the instructions hold 7 distinct images
    assert prepared["datasets"]["math"]["items_shared"] == 8 and prepared["datasets"]["instruct"]["items_shared"] == 5
    assert prepared["items_shared"] == 13 and prepared["items_encoded"] == 8 + 7 + 8
    data = PreparedData(run / "data")
    assert data.row("captions:shapes-0-000003").features == data.row("math:shapes-0-000003").features
    pair = data.row("instruct:pair-0")
    assert pair.num_items == 2 and [m["role"] for m in pair.messages] == ["user", "assistant"] * 2
    assert pair.messages[0]["content"].count("<image>") == 2 and not pair.messages[0]["content"].startswith("<image>")
    assert summary["evaluation"]["partition"] == "math.eval"
    assert "captions 8 rows; instruct 6 rows; math 16 rows; 23 items encoded, 13 shared" in stdout


def test_the_sft_summary_reports_the_mixtures_weights_and_realised_shares(three_run):
    _, run, stdout = three_run
    mixture = json.loads((run / "sft" / "summary.json").read_text())["data"]
    assert [(name, m["weight"]) for name, m in mixture.items()] == [("instruct", 0.8), ("captions", 0.2)]
    drawn = {name: m["drawn"] for name, m in mixture.items()}
    assert all(drawn.values()) and all(m["share"] == round(m["drawn"] / sum(drawn.values()), 4)
                                       for m in mixture.values())
    assert "drew instruct" in stdout and "(weight 80%)" in stdout


def test_sft_on_a_mixture_killed_after_a_checkpoint_resumes_to_the_same_batches(three_run, tmp_path):
    recipe, run, _ = three_run
    killed = tmp_path / "killed"
    shutil.copytree(run, killed, ignore=shutil.ignore_patterns("sft", "grpo", "summary.json"))
    train = cli("train", "sft", "--recipe", str(recipe), "--out", str(killed))
    kill_after_checkpoint(train, killed / "sft" / "checkpoints", 2, dict(os.environ))
    assert not (killed / "sft" / "checkpoints" / "step_4").exists(), "killed too late to test a resume"
    subprocess.run([*train, "--resume"], check=True, capture_output=True)

    def records(path: Path) -> list[dict]:
        lines = (path / "sft" / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if not (k.endswith("_s") or k == "tokens_per_s")}
                for line in lines]

    want, got = records(run), records(killed)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert got == want  # the same rows in the same packs: every loss and token count bitwise
    assert len({r["loss"] for r in want}) > 1
    assert json.loads((killed / "sft" / "summary.json").read_text())["data"] == \
        json.loads((run / "sft" / "summary.json").read_text())["data"]
