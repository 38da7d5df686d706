"""`stitch export`: a trained checkpoint as files that plain transformers (and any engine) loads.

``OUT/model/`` is the base LM with the LoRA adapter merged in (peft's ``merge_and_unload``), or with the LM's own
trained weights in place (``train_lm: full``), saved with
``save_pretrained`` (safetensors) with its tokenizer; ``OUT/projector/`` is the projector artifact (safetensors +
manifest with provenance); ``OUT/stitch-export.json`` names the encoder (and its pinned source), the sentinels,
the projector type and the prompt layout, so a user can rebuild the soft tokens without stitch.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from stitch.data.collator import media_block
from stitch.model.binding import ModelBinding
from stitch.plugins.registry import Registry
from stitch.serve.inference import merged_lm, resolve_checkpoint

EXPORT_FORMAT = "stitch.export/1"


def export_checkpoint(checkpoint: Path, out_dir: Path, registry: Registry, *,
                      dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Merge ``checkpoint``'s adapter (or put its trained LM weights) into its base LM and write the export to
    ``out_dir`` (atomically: a temporary sibling directory renamed into place). Returns the export manifest."""

    resolved = resolve_checkpoint(Path(checkpoint))
    projector_manifest = json.loads((resolved.projector_dir / "manifest.json").read_text())
    # the base the run trained on: its recorded snapshot, checked against its fingerprint before any weight loads
    binding = ModelBinding.for_artifact(projector_manifest, f"checkpoint {resolved.step_dir}", registry, dtype=dtype,
                                        device="cpu")
    model_spec, encoder_spec, tokenizer = binding.model_spec, binding.encoder_spec, binding.tokenizer
    # the layout of the encoder's modality: a video checkpoint's clips are bracketed by the family's video tokens
    sentinel_spec = binding.registry.get("token_sentinels", model_spec.sentinels).for_modality(encoder_spec.modality)
    sentinel_ids = binding.sentinel_ids
    if sentinel_ids.as_dict() != projector_manifest["sentinel_ids"]:
        raise ValueError(f"{resolved.projector_dir}: the projector was trained with sentinel ids "
                         f"{projector_manifest['sentinel_ids']}, but {model_spec.name}'s tokenizer gives "
                         f"{sentinel_ids.as_dict()}")
    merged = merged_lm(resolved, binding)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        merged.save_pretrained(tmp / "model", safe_serialization=True)
        tokenizer.save_pretrained(tmp / "model")
        shutil.copytree(resolved.projector_dir, tmp / "projector")
        tokens = encoder_spec.tokens_per_item
        source = encoder_spec.source.identity()
        manifest = {
            "format": EXPORT_FORMAT,
            "checkpoint": str(resolved.step_dir),
            "base_model": model_spec.name,
            "base_model_source": binding.base_identity(),  # the snapshot it was read from and its fingerprint
            "architecture": type(merged).__name__,
            "encoder": {"name": encoder_spec.name, "id": source["id"], "revision": source["revision"],
                        "modality": encoder_spec.modality, "feature_width": encoder_spec.feature_width,
                        "tokens_per_item": tokens},
            "projector": {"type": projector_manifest["projector_type"], "dir": "projector"},
            "sentinels": {"start": sentinel_spec.start, "placeholder": sentinel_spec.placeholder,
                          "end": sentinel_spec.end, "ids": sentinel_ids.as_dict()},
            # the prompt: the chat template over one user turn "<media block>\n<question>", generation prompt on
            "prompt": {"media_block": media_block(tokenizer, sentinel_ids, tokens, 1), "media_position":
                       f"where each {sentinel_spec.marker} marker stands, else opening the first user turn, followed "
                       f"by a newline", "chat_template": "model/tokenizer_config.json"},
        }
        (tmp / "stitch-export.json").write_text(json.dumps(manifest, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return manifest
