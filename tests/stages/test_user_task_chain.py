"""A user's own dataset with free-text answers (a local json file of PNG paths, colour words as answers, a
``rejected`` column) runs the whole chain on the tiny models: through `stitch run --dpo`, and through each
`stitch prepare` / `stitch train <stage>` command; evaluation and inference are graded by the recipe's task
(exact-match), not by the counting demo's number parser. The shipped `demo-colors` recipe runs too, shrunk."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stitch.host.host import get_host
from stitch.plugins.specs import TaskRow
from stitch.tasks.generic import exact_match

pytest.importorskip("stitch_clip", reason="the tiny CLIP encoder comes from the stitch-clip plugin")

COLORS = ("red", "green", "blue", "yellow", "purple", "cyan")
ROWS = 64
PARTITIONS = {"alignment": [0, 16], "train": [16, 48], "eval": [48, 56], "grpo": [56, 64]}
STAGES = {
    "alignment": {"partition": "alignment", "eval_partition": None, "steps": 2, "batch_size": 2, "save_every": 2},
    "sft": {"partition": "train", "eval_partition": "eval", "eval_rows": 8, "steps": 3, "batch_size": 2,
            "save_every": 3},
    "grpo": {"partition": "grpo", "eval_partition": "eval", "eval_rows": 8, "steps": 1, "prompts_per_step": 2,
             "group_size": 2, "max_new_tokens": 6, "save_every": 1},
    "dpo": {"partition": "train", "eval_partition": "eval", "eval_rows": 8, "steps": 1, "pairs_per_step": 2,
            "save_every": 1},
}


def _env() -> dict[str, str]:
    # the subprocess imports this checkout's stitch (and the cache the session fixture chose)
    repo = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


@pytest.fixture(scope="module")
def user_recipe(tmp_path_factory) -> Path:
    """``dataset/rows.jsonl`` + ``dataset/images/*.png`` written here, and a recipe in a sibling folder."""
    from stitch.demo.data import make_color_rows

    root = tmp_path_factory.mktemp("user-task")
    images = root / "dataset" / "images"
    images.mkdir(parents=True)
    with open(root / "dataset" / "rows.jsonl", "w") as handle:
        for i, row in enumerate(make_color_rows(ROWS, seed=7)):
            (images / f"{i:03d}.png").write_bytes(row["image"]["bytes"])
            wrong = random.Random(i).choice([c for c in COLORS if c != row["color"]])
            handle.write(json.dumps({"key": f"user-{i:03d}", "picture": f"images/{i:03d}.png",
                                     "prompt": "What colour is the shape?", "reply": row["color"],
                                     "worse": wrong}) + "\n")
    recipe = {
        "name": "user-colours",
        "model": "qwen3.5-demo",
        "encoder": "clip-tiny",
        "task": "exact-match",
        "data": {
            "source": {"path": "../dataset/rows.jsonl", "format": "json"},
            "columns": {"id": "key", "media": "picture", "question": "prompt", "answer": "reply",
                        "rejected": "worse"},
            "partitions": PARTITIONS,
            "scan_cap": ROWS,
            "budgets": {"transient_mib": 256, "retained_mib": 16},
            "feature_dtype": "float16",
        },
        "stages": STAGES,
    }
    path = root / "recipes" / "user.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def _graded_by_exact_match(records: list[dict], answers: set[str]) -> None:
    for r in records:
        assert r["expected"] in answers, r  # a colour answer, not a count
        assert r["score"] == exact_match(r["answer"], TaskRow(r["id"], r["question"], r["expected"])), r


@pytest.fixture(scope="module")
def chain_run(user_recipe, tmp_path_factory):
    out = tmp_path_factory.mktemp("user-run") / "run"
    res = subprocess.run([sys.executable, "-m", "stitch", "run", str(user_recipe), "--out", str(out), "--dpo"],
                         capture_output=True, text=True, env=_env())
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out, json.loads((out / "summary.json").read_text()), res.stdout


def test_stitch_run_takes_free_text_user_data_through_every_stage_including_dpo(chain_run):
    out, summary, _ = chain_run
    assert summary["task"] == "exact-match"
    assert summary["stages"]["prepare"]["rows"] == {"alignment": 16, "train": 32, "eval": 8, "grpo": 8}
    for stage in ("alignment", "sft", "grpo", "dpo"):
        assert Path(summary["stages"][stage]["checkpoint"]).is_dir(), stage
        assert (out / stage / "metrics.jsonl").read_text().strip(), stage
    for stage in ("sft", "grpo", "dpo"):
        assert 0.0 <= summary["stages"][stage]["eval_accuracy"] <= 1.0, stage
    # DPO paired every train row with the dataset's rejected column (the probe takes the first 32 pairs)
    assert summary["stages"]["dpo"]["probe_pairs"] == 32


def test_prepare_keeps_the_rejected_column_beside_each_row(chain_run):
    from stitch.data.feature_cache import PreparedData

    out, _, _ = chain_run
    rows = list(PreparedData(out / "data").rows("train"))
    assert all(r.extra["rejected"] in COLORS and r.extra["rejected"] != r.answer for r in rows)


def test_stitch_run_grades_the_final_checkpoint_with_the_task_against_the_majority_baseline(chain_run):
    _, summary, stdout = chain_run
    evaluation = summary["evaluation"]
    # --dpo ran DPO after GRPO: the chain grades the last stage it ran
    assert evaluation["task"] == "exact-match" and evaluation["stage"] == "dpo" == summary["final_stage"]
    assert "(scored by the reward of task 'exact-match'): accuracy" in stdout  # exact-match has no grader
    assert evaluation["partition"] == "eval" and evaluation["rows"] == 8
    assert 0.0 <= evaluation["accuracy"] <= 1.0 and 0.0 <= evaluation["zeroed_features_accuracy"] <= 1.0
    baseline = evaluation["majority_baseline"]
    assert baseline["answer"] in COLORS and 1 / 8 <= baseline["accuracy"] <= 1.0
    assert "majority answer" in stdout and "chance" not in stdout


def test_stitch_run_answers_held_out_rows_from_their_cached_features(chain_run):
    from stitch.data.feature_cache import PreparedData

    out, summary, stdout = chain_run
    inference = summary["inference"]
    eval_ids = [r.id for r in PreparedData(out / "data").rows("eval")]
    assert inference["held_out"] and inference["partition"] == "eval"
    assert [r["id"] for r in inference["rows"]] == eval_ids[:3]
    _graded_by_exact_match(inference["rows"], set(COLORS))
    assert inference["answer"] == inference["rows"][0]["answer"]
    assert all(r["id"] in stdout for r in inference["rows"])
    for name in ("loss.png", "accuracy.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_each_prepare_and_train_command_runs_on_the_user_dataset(user_recipe, tmp_path):
    from typer.testing import CliRunner

    from stitch.cli import app

    out = tmp_path / "run"
    runner = CliRunner()
    commands = [["prepare", "--recipe", str(user_recipe), "--out", str(out / "data")]]
    commands += [["train", stage, "--recipe", str(user_recipe), "--out", str(out)] for stage in STAGES]
    for args in commands:
        result = runner.invoke(app, args)
        assert result.exit_code == 0, (args, result.output[-3000:], result.exception)
    assert (out / "data" / "manifest.jsonl").is_file()
    for stage in STAGES:
        summary = json.loads((out / stage / "summary.json").read_text())
        assert Path(summary["checkpoint"]).is_dir(), stage
        if stage != "alignment":
            assert 0.0 <= summary["eval_accuracy"] <= 1.0, stage


def test_shipped_demo_colors_recipe_runs_the_whole_chain_shrunk(tmp_path):
    """`stitch run demo-colors --dpo` with fewer rows and steps (the shipped file, re-written smaller)."""
    from stitch.config.recipe import load_recipe

    shipped = load_recipe("demo-colors", get_host())
    raw = yaml.safe_load(shipped.path.read_text())
    raw["data"]["source"].update(rows=48, caption_rows=8)
    raw["data"]["partitions"] = {"alignment": [0, 8], "train": [8, 32], "eval": [32, 40], "grpo": [40, 48]}
    raw["data"]["scan_cap"] = 48
    for stage, opts in STAGES.items():
        raw["stages"][stage].update({k: v for k, v in opts.items() if k not in ("partition", "eval_partition")})
    path = tmp_path / "demo-colors-small.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "stitch", "run", str(path), "--out", str(out), "--dpo"],
                         capture_output=True, text=True, env=_env())
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "color-naming" and set(summary["stages"]) == {"prepare", *STAGES}
    assert summary["evaluation"]["task"] == "color-naming"
    _graded_by_exact_match(summary["inference"]["rows"], {f"The answer is {c}." for c in COLORS})
