"""Folding a plain-HF-format LoRA adapter into base weights with safetensors alone (no peft objects):
W <- W + (alpha / r) * B @ A for every adapted Linear. Used for serving and for engine refits."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

PEFT_PREFIX = "base_model.model."


class MergeError(ValueError):
    pass


def read_adapter(adapter_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    adapter_dir = Path(adapter_dir)
    config_path = adapter_dir / "adapter_config.json"
    weights_path = adapter_dir / "adapter_model.safetensors"
    for path in (config_path, weights_path):
        if not path.is_file():
            raise MergeError(f"{adapter_dir} is not a PEFT adapter directory: {path.name} is missing")
    return json.loads(config_path.read_text()), load_file(str(weights_path))


def lora_deltas(config: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Base-weight name -> delta (alpha/r * B @ A), from an adapter's tensors; refuses keys it cannot place."""
    if config.get("use_dora") or config.get("use_rslora"):
        raise MergeError("DoRA / rsLoRA adapters are not supported by the safetensors merge")
    if config.get("target_parameters"):
        raise MergeError(
            f"adapter targets fused parameters {config['target_parameters']}; merge those with peft's merge_and_unload"
        )
    scale = float(config["lora_alpha"]) / float(config["r"])
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if not key.startswith(PEFT_PREFIX):
            raise MergeError(f"adapter tensor {key!r} does not start with {PEFT_PREFIX!r}")
        stem = key[len(PEFT_PREFIX):]
        for part in ("lora_A", "lora_B"):
            marker = f".{part}.weight"
            if stem.endswith(marker):
                pairs.setdefault(stem[: -len(marker)], {})[part] = tensor
                break
        else:
            raise MergeError(f"adapter tensor {key!r} is neither a lora_A nor a lora_B weight")
    deltas = {}
    for module, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise MergeError(f"adapter module {module!r} has only {sorted(ab)}")
        deltas[f"{module}.weight"] = scale * (ab["lora_B"].float() @ ab["lora_A"].float())
    return deltas


def merge_into_state_dict(state: dict[str, torch.Tensor], deltas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A new state dict with the deltas added; every delta must land on an existing weight of its shape."""
    merged = dict(state)
    for name, delta in deltas.items():
        if name not in merged:
            raise MergeError(f"adapter adapts {name!r}, which the base model does not have")
        if tuple(merged[name].shape) != tuple(delta.shape):
            raise MergeError(f"adapter delta for {name!r} has shape {tuple(delta.shape)}, base has "
                             f"{tuple(merged[name].shape)}")
        merged[name] = (merged[name].float() + delta.to(merged[name].device)).to(merged[name].dtype)
    return merged


def merge_adapter_into_model(model: torch.nn.Module, adapter_dir: Path) -> int:
    """Fold ``adapter_dir`` into ``model``'s weights in place; returns how many weights changed."""
    config, tensors = read_adapter(adapter_dir)
    deltas = lora_deltas(config, tensors)
    state = model.state_dict()
    merged = merge_into_state_dict(state, deltas)
    with torch.no_grad():
        for name in deltas:
            state[name].copy_(merged[name])
    return len(deltas)
