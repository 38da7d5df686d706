"""Taking a trained model out of stitch: `stitch export` for plain transformers, `stitch serve` for OpenAI clients,
`stitch infer --input` for a JSONL of rows."""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import subprocess
import sys
import time
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _png(size: tuple[int, int] = (224, 224)) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 40, 40)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def server(sft_run):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "stitch", "serve", str(sft_run), "--port", str(port), "--model-name", "tiny",
         "--max-image-pixels", "250000"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    import urllib.request

    deadline = time.monotonic() + 240
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"server did not start: {proc.stdout.read()[-3000:]}") from None
            time.sleep(0.5)
    try:
        yield f"http://127.0.0.1:{port}/v1", proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_answers_the_openai_client_like_stitch_infer_and_survives_malformed_requests(server, sft_run, tmp_path):
    import openai

    base_url, proc = server
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    image = tmp_path / "scene.png"
    image.write_bytes(_png())
    question = "How many objects are in the image?"
    data_url = "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()

    def ask(url: str = data_url, model: str = "tiny", with_image: bool = True):
        content = [{"type": "text", "text": question}]
        if with_image:
            content.append({"type": "image_url", "image_url": {"url": url}})
        return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                              max_tokens=24)

    served = ask().choices[0].message.content
    infer = subprocess.run([sys.executable, "-m", "stitch", "infer", "--adapter", str(sft_run / "sft" / "checkpoints"),
                            "--image", str(image), "--question", question],
                           capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert served + "\n" == infer.stdout

    big = "data:image/png;base64," + base64.b64encode(_png((1000, 1000))).decode()
    bad_requests = {
        "bad base64": (lambda: ask(url="data:image/png;base64,@@not-base64@@"), 400),
        "no image": (lambda: ask(with_image=False), 400),
        "unknown model": (lambda: ask(model="gpt-4o"), 404),
        "oversize image": (lambda: ask(url=big), 400),
    }
    for what, (call, status) in bad_requests.items():
        with pytest.raises(openai.APIStatusError) as caught:
            call()
        assert caught.value.status_code == status, what
        assert caught.value.body["message"], what  # an OpenAI-shaped JSON error with a message
        assert ask().choices[0].message.content == served, f"the server stopped answering after: {what}"
    assert proc.poll() is None


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
