"""The warm-start gate: a donor checkpoint's adapter and projector must match this run before any model
weights load (rank, alpha, exact target set, base model and its snapshot's identity, feature width, tokens per
item, sentinels)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class ProvenanceError(ValueError):
    """The donor checkpoint does not fit this run; the message names the field, expected and actual."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ProvenanceError(f"warm start: {path} is missing; the donor checkpoint is incomplete")
    return json.loads(path.read_text())


def check_warm_start(step_dir: Path, expected: dict[str, Any]) -> None:
    """Compare the donor ``step_dir`` (adapter/ + projector/) with ``expected``; refuse the first mismatch.

    ``expected`` keys: lora_r, lora_alpha, target_modules (set), base_model, base_model_fingerprint (the base
    snapshot's identity), feature_width, tokens_per_item, sentinel_ids (dict), projector_type.
    """
    adapter = _read_json(step_dir / "adapter" / "adapter_config.json")
    projector = _read_json(step_dir / "projector" / "manifest.json")
    actual = {
        "lora_r": adapter.get("r"),
        "lora_alpha": adapter.get("lora_alpha"),
        "target_modules": sorted(adapter.get("target_modules") or []),
        "base_model": projector.get("base_model"),
        "base_model_fingerprint": projector.get("base_model_fingerprint"),
        "feature_width": projector.get("feature_width"),
        "tokens_per_item": projector.get("tokens_per_item"),
        "sentinel_ids": projector.get("sentinel_ids"),
        "projector_type": projector.get("projector_type"),
    }
    want = dict(expected)
    want["target_modules"] = sorted(want["target_modules"])
    for field, value in want.items():
        if actual.get(field) != value:
            raise ProvenanceError(
                f"warm start from {step_dir}: field {field!r} expected {value!r}, donor has {actual.get(field)!r}; "
                f"the donor was trained for a different configuration"
            )
