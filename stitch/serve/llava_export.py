"""`stitch export --format llava`: a checkpoint as one transformers LLaVA directory (vision tower, projector, LM with
the LoRA adapter merged; processor with the image token, patch count and chat template) that
``AutoModelForImageTextToText`` / ``AutoProcessor`` / the ``image-text-to-text`` pipeline load without stitch.

It applies where stitch's model *is* LLaVA: a CLIP-family vision tower whose penultimate-layer patch tokens
(CLS dropped) are the features, and an ``mlp2x_gelu`` projector (LLaVA's two-layer GELU MLP) or a ``linear`` one
(LLaVA's MLP with an identity activation and an identity second layer). Any other encoder keeps the default
format (``stitch.serve.export``).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    CLIPVisionModel,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
)

from stitch.model.binding import ModelBinding
from stitch.plugins.registry import Registry
from stitch.serve.inference import merged_lm, resolve_checkpoint

LLAVA_PROJECTORS = {"mlp2x_gelu": "gelu", "linear": "linear"}  # stitch projector -> LLaVA projector_hidden_act
CLIP_MODEL_TYPES = ("clip_vision_model", "clip")
SELECT_LAYER = -2  # the penultimate layer's patch tokens, what stitch's CLIP encoders return

# Turns a message whose content is a list of parts ({"type": "image"} / {"type": "text", "text": ...}) into the
# text stitch's prompt builder gives it: one media block per image (start, the image token, end; the processor
# expands the image token to the patch count), a newline, then the text. Placed before the LM's own template.
_FLATTEN = (
    "{%- set flat = namespace(messages=[]) -%}"
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}"
    "{%- set flat.messages = flat.messages + [message] -%}"
    "{%- else -%}"
    "{%- set parts = namespace(media='', text='') -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{%- set parts.media = parts.media + MEDIA -%}"
    "{%- elif part['type'] == 'text' -%}{%- set parts.text = parts.text + part['text'] -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- set content = (parts.media + '\\n' + parts.text) if parts.media else parts.text -%}"
    "{%- set flat.messages = flat.messages + [{'role': message['role'], 'content': content}] -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- set messages = flat.messages -%}"
)


class LlavaExportError(ValueError):
    """A checkpoint whose encoder or projector has no LLaVA counterpart."""


def encoder_config(encoder_spec: Any) -> Any:
    """The transformers config of the encoder's pinned snapshot (no weights load)."""

    return AutoConfig.from_pretrained(**encoder_spec.source.pretrained_kwargs())


def llava_refusal(encoder_spec: Any, projector_type: str) -> str | None:
    """Why this encoder + projector has no LLaVA counterpart, or None when it has one."""
    if projector_type not in LLAVA_PROJECTORS:
        return (f"projector {projector_type!r} has no LLaVA counterpart (LLaVA's projector is "
                f"{' or '.join(LLAVA_PROJECTORS)})")
    if encoder_spec.modality != "image":  # a clip's frames are a CLIP tower's input too, but LLaVA reads one image
        return (f"encoder {encoder_spec.name!r} encodes {encoder_spec.modality} ({encoder_spec.tokens_per_item} tokens "
                f"per item); the llava format holds image encoders only")
    model_type = getattr(encoder_config(encoder_spec), "model_type", None)
    if model_type not in CLIP_MODEL_TYPES:
        return (f"encoder {encoder_spec.name!r} is a {model_type!r} model; the llava format takes CLIP-family "
                f"vision towers ({', '.join(CLIP_MODEL_TYPES)})")
    return None


def chat_template(tokenizer: Any, media: str) -> str:
    """The LM's chat template behind ``_FLATTEN``, with ``media`` (start + image token + end) as its media block."""
    template = tokenizer.chat_template
    if not isinstance(template, str):
        raise LlavaExportError("the tokenizer has no single chat template to build the processor's from")
    return "{%- set MEDIA = " + json.dumps(media) + " -%}" + _FLATTEN + template


def projector_layers(weights: dict[str, torch.Tensor], projector_type: str, hidden: int) -> dict[str, torch.Tensor]:
    """The projector artifact's tensors as LLaVA's ``multi_modal_projector`` (linear_1, act, linear_2)."""
    if projector_type == "mlp2x_gelu":
        return {"linear_1.weight": weights["0.weight"], "linear_1.bias": weights["0.bias"],
                "linear_2.weight": weights["2.weight"], "linear_2.bias": weights["2.bias"]}
    dtype = weights["weight"].dtype
    return {"linear_1.weight": weights["weight"], "linear_1.bias": weights["bias"],
            "linear_2.weight": torch.eye(hidden, dtype=dtype), "linear_2.bias": torch.zeros(hidden, dtype=dtype)}


def build_llava(merged: Any, vision: Any, projector: dict[str, torch.Tensor], projector_type: str,
                image_token_id: int, tokens_per_item: int) -> Any:
    """A ``LlavaForConditionalGeneration`` holding ``merged`` (a causal LM), ``vision`` (a CLIP vision model) and
    the projector's tensors."""

    text_config = merged.config.get_text_config()
    config = LlavaConfig(
        vision_config=vision.config.to_dict(), text_config=text_config.to_dict(), image_token_id=image_token_id,
        projector_hidden_act=LLAVA_PROJECTORS[projector_type], vision_feature_layer=SELECT_LAYER,
        vision_feature_select_strategy="default", image_seq_length=tokens_per_item,
        multimodal_projector_bias=True, tie_word_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)))
    model = LlavaForConditionalGeneration(config).to(merged.dtype).eval()
    model.model.vision_tower.load_state_dict(vision.state_dict())
    model.model.multi_modal_projector.load_state_dict(projector)
    model.model.language_model.load_state_dict(merged.base_model.state_dict())
    model.lm_head.load_state_dict(merged.get_output_embeddings().state_dict())
    return model


def export_llava(checkpoint: Path, out_dir: Path, registry: Registry, *,
                 dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Write ``checkpoint`` as a LLaVA directory to ``out_dir`` (atomically: a temporary sibling renamed into
    place). Refuses, before any weight loads, a checkpoint whose encoder or projector LLaVA cannot express."""

    resolved = resolve_checkpoint(Path(checkpoint))
    projector_manifest = json.loads((resolved.projector_dir / "manifest.json").read_text())
    binding = ModelBinding.for_artifact(projector_manifest, f"checkpoint {resolved.step_dir}", registry, dtype=dtype,
                                        device="cpu")
    encoder_spec, tokenizer, ids = binding.encoder_spec, binding.tokenizer, binding.sentinel_ids
    projector_type = projector_manifest["projector_type"]
    refusal = llava_refusal(encoder_spec, projector_type)
    if refusal is not None:
        raise LlavaExportError(f"checkpoint {resolved.step_dir}: {refusal}; use the default format "
                               f"(stitch export without --format llava)")
    sentinels = binding.registry.get("token_sentinels", binding.model_spec.sentinels)
    kwargs = encoder_spec.source.pretrained_kwargs()
    vision = CLIPVisionModel.from_pretrained(**kwargs, use_safetensors=True, dtype=dtype)
    merged = merged_lm(resolved, binding)
    weights = load_file(str(resolved.projector_dir / "mm-projector.safetensors"))
    hidden = merged.get_input_embeddings().weight.shape[1]
    model = build_llava(merged, vision, projector_layers(weights, projector_type, hidden), projector_type,
                        ids.placeholder, encoder_spec.tokens_per_item)
    model.generation_config.suppress_tokens = sorted(set(ids.as_dict().values()))  # sentinels are never sampled
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.do_sample = False
    processor = LlavaProcessor(
        image_processor=AutoImageProcessor.from_pretrained(**kwargs), tokenizer=tokenizer,
        patch_size=vision.config.patch_size, vision_feature_select_strategy="default",
        image_token=sentinels.placeholder, num_additional_image_tokens=1,
        chat_template=chat_template(tokenizer, sentinels.start + sentinels.placeholder + sentinels.end))
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    manifest = {"format": "llava", "checkpoint": str(resolved.step_dir), "base_model": binding.model_spec.name,
                "encoder": encoder_spec.name, "projector": projector_type, "image_token": sentinels.placeholder,
                "image_seq_length": encoder_spec.tokens_per_item}
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        processor.save_pretrained(tmp)
        (tmp / "stitch-export.json").write_text(json.dumps(manifest, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return manifest
