"""The native Qwen3.5 VLM checkpoint layout and its mapping onto the text-only causal LM."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stitch.api import StateDictAdapterSpec

LANGUAGE_MODEL_PREFIX = "model.language_model."
TEXT_MODEL_PREFIX = "model."
LM_HEAD = "lm_head.weight"

# Key prefixes the text LM deliberately leaves behind, each with the reason it is safe to drop.
DROPPED_PREFIXES: dict[str, str] = {
    "model.visual.": "Qwen's own vision tower: stitch feeds images through its frozen encoder + projector "
    "(route 'clip_image'), so this tower stays frozen and unused",
    "mtp.": "the multi-token-prediction head, used only for speculative decoding; the causal LM has no slot for it",
}


class StateDictLayoutError(ValueError):
    """A checkpoint key that a layout adapter cannot place."""


def is_vlm_layout(snapshot: Path) -> bool:
    """True when ``snapshot/config.json`` is a Qwen3.5 VLM config (the text model nested as ``text_config``)."""
    config = json.loads((Path(snapshot) / "config.json").read_text())
    return "text_config" in config


def convert_vlm_to_text(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Map VLM keys (``model.language_model.*``, ``lm_head``) to text-LM keys; drop the vision tower and MTP head.

    Values are read only for kept keys, so a lazy mapping never loads the dropped tensors. Any key outside
    the known layout is refused by name.
    """
    converted: dict[str, Any] = {}
    unplaced: list[str] = []
    for key in state_dict:
        if key.startswith(tuple(DROPPED_PREFIXES)):
            continue
        if key.startswith(LANGUAGE_MODEL_PREFIX):
            converted[TEXT_MODEL_PREFIX + key[len(LANGUAGE_MODEL_PREFIX) :]] = state_dict[key]
        elif key == LM_HEAD:
            converted[key] = state_dict[key]
        else:
            unplaced.append(key)
    if unplaced:
        shown = ", ".join(repr(k) for k in sorted(unplaced)[:8])
        more = f" (and {len(unplaced) - 8} more)" if len(unplaced) > 8 else ""
        raise StateDictLayoutError(
            f"qwen3.5-vlm-to-text cannot place {len(unplaced)} checkpoint key(s): {shown}{more}. It maps "
            f"{LANGUAGE_MODEL_PREFIX}* and {LM_HEAD} and drops {', '.join(p + '*' for p in DROPPED_PREFIXES)}; "
            f"a checkpoint with other keys is not the Qwen3.5 VLM layout this adapter was written for."
        )
    return converted


def text_config_of(vlm_config: Any, state_dict: Mapping[str, Any]) -> Any:
    """The text LM's config from the VLM's: its nested ``text_config``, tied to the embeddings when the checkpoint
    ships no ``lm_head`` of its own (the small Qwen3.5 models share the embedding matrix)."""
    text_config = vlm_config.get_text_config()
    text_config.tie_word_embeddings = LM_HEAD not in state_dict and bool(
        getattr(vlm_config, "tie_word_embeddings", False) or getattr(text_config, "tie_word_embeddings", False)
    )
    return text_config


VLM_TO_TEXT = StateDictAdapterSpec(
    name="qwen3.5-vlm-to-text",
    source_layout="Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration (native VLM checkpoint)",
    target_layout="Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM (text LM)",
    convert=convert_vlm_to_text,
    applies_to=is_vlm_layout,
    convert_config=text_config_of,
    description="model.language_model.* -> model.*, lm_head kept; model.visual.* (Qwen's own vision tower, "
    "frozen and unused) and mtp.* dropped explicitly; any other key is refused by name.",
)
