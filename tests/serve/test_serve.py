"""Taking a trained model out of stitch: `stitch export` for plain transformers and `stitch infer --input` for a
JSONL of rows (`stitch serve` is tested in test_server.py)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stitch.host.host import get_host

pytestmark = pytest.mark.slow


def _eval_rows(run: Path, n: int = 4):
    from stitch.data.feature_cache import PreparedData

    data = PreparedData(run / "data")
    rows = list(data.rows("eval"))[:n]
    return [(row, data.features(row).float()) for row in rows]


def test_exported_model_loads_in_plain_transformers_and_reproduces_stitchs_greedy_answers(sft_run, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stitch.serve.export import export_checkpoint
    from stitch.serve.inference import Stitched

    out = tmp_path / "export"
    manifest = export_checkpoint(sft_run / "sft" / "checkpoints", out, registry=get_host())
    stitched = Stitched(sft_run / "sft" / "checkpoints", registry=get_host())
    rows = _eval_rows(sft_run)
    expected = [stitched.answer_features(feats, row.question, max_new_tokens=12) for row, feats in rows]

    # from here on: transformers, safetensors and torch only, reading what the export wrote
    exported = json.loads((out / "stitch-export.json").read_text())
    lm = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32, use_safetensors=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    weights = load_file(str(out / "projector" / "mm-projector.safetensors"))
    assert exported["projector"]["type"] == "mlp2x_gelu"

    def project(features: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.gelu(features @ weights["0.weight"].T + weights["0.bias"])
        return hidden @ weights["2.weight"].T + weights["2.bias"]

    placeholder = exported["sentinels"]["ids"]["placeholder"]
    suppress = list(exported["sentinels"]["ids"].values())
    answers = []
    for row, feats in rows:
        messages = [{"role": "user", "content": exported["prompt"]["media_block"] + "\n" + row.question}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        embeds = lm.get_input_embeddings()(ids)
        embeds[ids == placeholder] = project(feats).reshape(-1, embeds.shape[-1])
        with torch.no_grad():
            generated = lm.generate(inputs_embeds=embeds, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                    do_sample=False, suppress_tokens=suppress,
                                    pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        answers.append(tokenizer.decode(generated[0], skip_special_tokens=True))
    assert manifest["base_model"] == stitched.model_spec.name
    assert answers == expected


def _png(size: tuple[int, int] = (224, 224)) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 40, 40)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_infer_answers_a_jsonl_of_rows_with_the_same_text_as_one_at_a_time(sft_run, tmp_path):
    image = tmp_path / "a.png"
    image.write_bytes(_png())
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "a", "image": "a.png", "question": "How many objects are in the image?"}) + "\n"
                    + json.dumps({"id": "b", "image": str(image), "question": "Describe the image."}) + "\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ckpt = str(sft_run / "sft" / "checkpoints")
    subprocess.run([sys.executable, "-m", "stitch", "infer", "--adapter", ckpt, "--input", str(rows),
                    "--output", str(tmp_path / "answers.jsonl")], check=True, capture_output=True, env=env)
    answers = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert [a["id"] for a in answers] == ["a", "b"]
    single = subprocess.run([sys.executable, "-m", "stitch", "infer", "--adapter", ckpt, "--image", str(image),
                             "--question", "Describe the image."], check=True, capture_output=True, text=True, env=env)
    assert answers[1]["answer"] + "\n" == single.stdout  # typer.echo ends the one answer with a newline


def test_infer_refuses_a_jsonl_row_without_a_question_before_loading_the_model(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"image": "a.png"}) + "\n")
    result = subprocess.run([sys.executable, "-m", "stitch", "infer", "--adapter", str(tmp_path), "--input", str(rows)],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "line 1: field 'question': expected a string" in result.stderr
