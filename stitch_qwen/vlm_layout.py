"""The native Qwen3.5 VLM checkpoint layout and its mapping onto the text-only causal LM."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
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


VLM_TO_TEXT = StateDictAdapterSpec(
    name="qwen3.5-vlm-to-text",
    source_layout="Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration (native VLM checkpoint)",
    target_layout="Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM (text LM)",
    convert=convert_vlm_to_text,
    description="model.language_model.* -> model.*, lm_head kept; model.visual.* (Qwen's own vision tower, "
    "frozen and unused) and mtp.* dropped explicitly; any other key is refused by name.",
)


class SafetensorsStateDict(Mapping[str, Any]):
    """A read-on-access view of a snapshot's safetensors shards (``model.safetensors`` or an index)."""

    def __init__(self, snapshot: Path) -> None:
        snapshot = Path(snapshot)
        index = snapshot / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            self._files = {key: snapshot / name for key, name in weight_map.items()}
        elif (snapshot / "model.safetensors").exists():
            from safetensors import safe_open

            path = snapshot / "model.safetensors"
            with safe_open(path, framework="pt") as handle:
                self._files = {key: path for key in handle.keys()}  # noqa: SIM118 (safe_open is not a dict)
        else:
            found = sorted(p.name for p in snapshot.iterdir())
            raise FileNotFoundError(
                f"{snapshot} has no model.safetensors or model.safetensors.index.json (found: {found}); "
                f"stitch loads weights from safetensors only"
            )
        self._handles: dict[Path, Any] = {}

    def __getitem__(self, key: str) -> Any:
        from safetensors import safe_open

        path = self._files[key]
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path].get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)
