"""The video route learns on a CPU: moving-ball MP4 clips (which way does the ball move: left, right, up or down)
prepared through clip-demo-video (4 frames, each encoded once, pooled in pairs) and taught to the demo base by
`stitch prepare` + `stitch train alignment` + `stitch train sft`; held-out accuracy on 200 clips must beat the
zeroed-feature control by at least 20 points."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stitch.host.host import get_host

pytest.importorskip("av", reason="the video route decodes clips with PyAV (stitch-clip[video])")
pytest.importorskip("stitch_clip", reason="the video encoder comes from the stitch-clip plugin")

TRAIN_ROWS, EVAL_ROWS = 640, 200
MIN_GAIN = 0.20  # held-out accuracy over the zeroed-feature control (chance: 25 %)
RECIPE = {
    "name": "moving-ball",
    "model": "qwen3.5-demo",
    "encoder": "clip-demo-video",
    "task": "exact-match",
    "data": {
        "source": {"path": "../dataset/rows.jsonl", "format": "json"},
        "columns": {"id": "id", "media": "video", "question": "question", "answer": "answer"},
        "partitions": {"train": [0, TRAIN_ROWS], "eval": [TRAIN_ROWS, TRAIN_ROWS + EVAL_ROWS]},
        "scan_cap": TRAIN_ROWS + EVAL_ROWS,
        "budgets": {"transient_mib": 256, "retained_mib": 64},
        "feature_dtype": "float16",
        "encode_batch_size": 32,
        "shard_rows": 256,
    },
    "stages": {
        "alignment": {"partition": "train", "eval_partition": None, "steps": 40, "batch_size": 4,
                      "lr_projector": 1.0e-3},
        # constant LR: held-out accuracy sits at chance for ~250 steps (the LoRA first learns to spell the four
        # answers), then rises within ~100 steps; a cosine decay over 240 steps stopped it before that (measured)
        "sft": {"partition": "train", "eval_partition": "eval", "eval_rows": EVAL_ROWS, "steps": 500,
                "batch_size": 3, "schedule": "constant", "lr_projector": 2.0e-3, "lr_adapter": 5.0e-3,
                "lora": {"r": 16, "alpha": 32, "dropout": 0.0}},
    },
}


def _stitch(*args: str) -> str:
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    res = subprocess.run([sys.executable, "-m", "stitch", *args], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


@pytest.fixture(scope="module")
def video_sft(tmp_path_factory):
    from stitch_clip.moving_ball import write_dataset

    root = tmp_path_factory.mktemp("moving-ball")
    write_dataset(root / "dataset", TRAIN_ROWS + EVAL_ROWS, seed=3)
    recipe = root / "recipes" / "moving-ball.yaml"
    recipe.parent.mkdir()
    recipe.write_text(yaml.safe_dump(RECIPE, sort_keys=False))
    out = root / "run"
    report = _stitch("prepare", "--recipe", str(recipe), "--out", str(out / "data"))
    _stitch("train", "alignment", "--recipe", str(recipe), "--out", str(out))
    _stitch("train", "sft", "--recipe", str(recipe), "--out", str(out))
    return recipe, out, report


# Measured 1.00 held out against a zeroed-feature control of 0.00 (the majority answer: 0.25). The run takes 4-5
# minutes of one core (prepare ~1, SFT ~2): under `-n auto` it runs beside the rest of the suite.
@pytest.mark.slow
def test_sft_on_moving_ball_clips_beats_the_zeroed_feature_control_by_20_points(video_sft):
    from stitch.config.recipe import load_recipe
    from stitch.stages.evaluation import evaluate_accuracy
    from stitch.stages.session import StitchSession

    recipe_path, out, _ = video_sft
    prepared = json.loads((out / "data" / "prepare-report.json").read_text())
    assert prepared["rows"]["eval"] == EVAL_ROWS and prepared["items_encoded"] == TRAIN_ROWS + EVAL_ROWS
    host = get_host()
    session = StitchSession.open(load_recipe(str(recipe_path), host), out, registry=host)
    step = Path(json.loads((out / "sft" / "summary.json").read_text())["checkpoint"])
    model = session.binding.build_model(adapter_from=step / "adapter", projector_from=step / "projector")
    accuracy = json.loads((out / "sft" / "summary.json").read_text())["eval_accuracy"]
    control = evaluate_accuracy(session, model, "eval", limit=EVAL_ROWS, zero_features=True)
    print(f"moving-ball SFT held-out accuracy {accuracy:.3f}, zeroed-feature control {control:.3f}")
    assert accuracy >= control + MIN_GAIN, (accuracy, control)
