"""`stitch infer --media`: any modality's input files, repeatable for several items, `--image` kept as its alias,
and JSONL rows that name their files under `media` (or `image`), all checked before the model loads."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from stitch.cli import app
from stitch.serve.inference import Stitched


def _png(path: Path, colour: tuple[int, int, int]) -> Path:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), colour).save(buffer, format="PNG")
    path.write_bytes(buffer.getvalue())
    return path


@pytest.fixture
def prompt_items(monkeypatch) -> list[int]:
    """How many items each answered prompt carried, recorded from Stitched.answer_features (which still runs)."""
    seen: list[int] = []
    real = Stitched.answer_features

    def spy(self, features: torch.Tensor, question: str, max_new_tokens: int = 24) -> str:
        seen.append(int(features.shape[0]))
        return real(self, features, question, max_new_tokens)

    monkeypatch.setattr(Stitched, "answer_features", spy)
    return seen


def test_infer_media_is_repeatable_and_image_is_its_alias_with_the_same_answers(sft_run, tmp_path, prompt_items):
    red, blue = _png(tmp_path / "red.png", (200, 40, 40)), _png(tmp_path / "blue.png", (40, 40, 200))
    ckpt = str(sft_run / "sft" / "checkpoints")
    ask = ["infer", "--adapter", ckpt, "--question", "How many objects are in the image?"]
    both = CliRunner().invoke(app, [*ask, "--media", str(red), "--media", str(blue)])
    assert both.exit_code == 0, both.output
    alias = CliRunner().invoke(app, [*ask, "--image", str(red), "--image", str(blue)])
    assert alias.exit_code == 0, alias.output
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "m", "media": ["red.png", "blue.png"], "question": ask[-1]}) + "\n"
                    + json.dumps({"id": "i", "image": "red.png", "question": ask[-1]}) + "\n")
    listed = CliRunner().invoke(app, ["infer", "--adapter", ckpt, "--input", str(rows),
                                      "--output", str(tmp_path / "answers.jsonl")])
    assert listed.exit_code == 0, listed.output
    answers = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert prompt_items == [2, 2, 2, 1]  # every file became one item of its row's prompt
    assert both.stdout.splitlines()[-1] == alias.stdout.splitlines()[-1] == answers[0]["answer"]
    assert [(a["id"], a.get("media"), a.get("image")) for a in answers] == [
        ("m", ["red.png", "blue.png"], None), ("i", None, "red.png")]  # rows come back as given, plus the answer


@pytest.mark.parametrize(
    ("row", "says"),
    [
        ({"media": "gone.npy", "question": "q"}, "line 1: field 'media': {dir}/gone.npy does not exist"),
        ({"media": [], "question": "q"}, "line 1: field 'media': expected a file path or a non-empty list"),
        ({"media": "x.npy", "image": "x.npy", "question": "q"}, "line 1: expected one of the fields 'media', 'images' or"),
        ({"question": "q"}, "line 1: expected one of the fields 'media', 'images' or 'image'"),
    ],
    ids=["missing-file", "empty-list", "both-keys", "no-media"],
)
def test_infer_refuses_a_bad_media_row_naming_line_and_field_before_loading_the_model(tmp_path, row, says):
    (tmp_path / "x.npy").write_bytes(b"")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(row) + "\n")
    # the adapter path does not exist: reaching the model load would fail with another message
    result = subprocess.run([sys.executable, "-m", "stitch", "infer", "--adapter", str(tmp_path / "none"),
                             "--input", str(rows)], capture_output=True, text=True,
                            env={**os.environ, "COLUMNS": "400"})
    assert result.returncode == 2
    assert says.format(dir=tmp_path) in result.stderr, result.stderr
