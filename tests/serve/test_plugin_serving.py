"""A non-image modality served end to end: a plugin scaffolded by `stitch new-plugin`'s template, its encoder
declaring OpenAI ``input_audio`` parts, trained by `stitch run` on its shipped recipe, then answered through
`stitch serve` with the openai client exactly as `stitch infer` answers the same signal."""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stitch.scaffold import render_plugin
from tests.stitch_testing import cli, start_server

pytestmark = pytest.mark.slow

MODALITY = "probe_wave"  # unusual on purpose: never collides with an installed plugin
PACKAGE = "stitch_probe_wave"
HAS_HATCHLING = importlib.util.find_spec("hatchling") is not None


# The scaffold's demo recipe with enough data and steps to learn: 240 signals written by the plugin's own
# demo_data.py, the pretrained qwen3.5-demo LM, 90 SFT steps (about 1.5 minutes on 2 cores).
RECIPE = f"""\
name: {MODALITY}-learns
model: qwen3.5-demo
encoder: {MODALITY}-encoder
projector: mlp2x_gelu
task: counting
data:
  source: {{path: data/train.jsonl, format: json}}
  columns: {{id: id, media: {MODALITY}, question: question, answer: answer}}
  partitions: {{alignment: [0, 40], train: [40, 200], eval: [200, 240]}}
  scan_cap: 240
  budgets: {{transient_mib: 256, retained_mib: 64}}
  on_corrupt: error
  feature_dtype: float32
stages:
  alignment: {{partition: alignment, eval_partition: null, steps: 10, batch_size: 4, lr_projector: 1.0e-3}}
  sft: {{partition: train, eval_partition: eval, eval_rows: 40, steps: 90, batch_size: 8,
        lr_projector: 3.0e-3, lr_adapter: 3.0e-3, lora: {{r: 8, alpha: 16}}}}
"""


def _declare_input_audio(encoder_py: Path) -> None:
    """The plugin author's one edit: the encoder takes its signals as ``input_audio`` content parts."""
    text = encoder_py.read_text()
    patched, count = re.subn(r"^CONTENT_PARTS = \(.*\)$", 'CONTENT_PARTS = ("input_audio",)', text, flags=re.M)
    assert count == 1, "the rendered encoder.py has no CONTENT_PARTS = (...) line to declare content parts in"
    encoder_py.write_text(patched)


def _install(project: Path, site: Path) -> dict[str, str]:
    isolation = ["--no-build-isolation", "--no-index"] if HAS_HATCHLING else []
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *isolation, "--target", str(site),
                    str(project)], check=True, capture_output=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("STITCH_LOAD_PLUGINS", "STITCH_DISABLED_PLUGINS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return {**env, "OMP_NUM_THREADS": "1"}


def test_a_scaffolded_audio_plugin_answers_input_audio_parts_through_serve_as_infer_does(tmp_path):
    import openai

    project = render_plugin(tmp_path / "out", MODALITY)
    _declare_input_audio(project / "src" / PACKAGE / "encoder.py")
    env = _install(project, tmp_path / "site")
    package = project / "src" / PACKAGE
    subprocess.run([sys.executable, str(package / "demo_data.py"), "--rows", "240", "--out", str(tmp_path / "data")],
                   check=True, capture_output=True, timeout=120)
    recipe = tmp_path / "learns.yaml"
    recipe.write_text(RECIPE)
    run = tmp_path / "run"
    trained = subprocess.run(cli("run", str(recipe), "--out", str(run)), capture_output=True, text=True, env=env,
                             timeout=1200)
    assert trained.returncode == 0, trained.stderr[-3000:]
    evaluation = json.loads((run / "summary.json").read_text())["evaluation"]
    # the signal carries the answer: the trained model beats itself with its features zeroed
    assert evaluation["rows"] == 40 and evaluation["accuracy"] > evaluation["zeroed_features_accuracy"] + 0.2, evaluation
    checkpoints = run / "sft" / "checkpoints"
    signal = tmp_path / "data" / "items" / "s232.npy"  # an eval row
    question = "How many cycles does this signal go through?"
    infer = subprocess.run(cli("infer", "--adapter", str(checkpoints), "--media", str(signal), "--question", question,
                               "--max-new-tokens", "8"), check=True, capture_output=True, text=True, env=env)

    proc, port = start_server(run, "--model-name", "probe", env=env)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(signal.read_bytes()).decode(),
                                                        "format": "wav"}}
        reply = client.chat.completions.create(model="probe", max_tokens=8, temperature=0, messages=[
            {"role": "user", "content": [audio, {"type": "text", "text": question}]}])
        assert reply.choices[0].message.content + "\n" == infer.stdout
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="probe", max_tokens=8, messages=[
                {"role": "user", "content": [image, {"type": "text", "text": question}]}])
        assert "input_audio" in refused.value.body["message"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
