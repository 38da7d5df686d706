"""The LM's own weights as a trained part (``train_lm: full``): which of them train (all, or chosen decoder layers
and name patterns), and their save and restore as one safetensors file beside the projector artifact."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from stitch.model.checkpointing import decoder_layers

LM_DIR = "lm"  # a checkpoint step's folder of the LM's trained weights
WEIGHTS_NAME = "model.safetensors"


class LmSelectionError(ValueError):
    """A ``train_lm_layers`` entry that names no part of the model."""


def selected_parameters(lm: nn.Module, layers: Sequence[int | str] | None, where: str) -> list[str]:
    """Names (``lm.named_parameters()``) of the weights that train: every one for ``layers`` None; else those of
    the decoder layers at the given indices and those matching the given fnmatch patterns (a tied weight matches
    under either of its names, e.g. ``lm_head.weight``). An index out of range or a pattern that matches nothing is
    refused, naming it and ``where``."""
    names = [name for name, _ in lm.named_parameters()]
    if layers is None:
        return names
    owner = {id(param): name for name, param in lm.named_parameters()}
    aliases = {name: owner[id(param)] for name, param in lm.named_parameters(remove_duplicate=False)}
    blocks = decoder_layers(lm)
    chosen: set[str] = set()
    for entry in layers:
        if isinstance(entry, int):
            if entry >= len(blocks):
                raise LmSelectionError(f"{where}: layer {entry} is not in this model; its decoder has {len(blocks)} "
                                       f"layers (0 to {len(blocks) - 1})")
            found = [owner[id(p)] for p in blocks[entry].parameters() if id(p) in owner]
        else:
            found = [aliases[name] for name in fnmatch.filter(aliases, entry)]
            if not found:
                raise LmSelectionError(f"{where}: {entry!r} matches none of the LM's {len(aliases)} parameter names "
                                       f"(those of its transformers model's named_parameters(), e.g. "
                                       f"{', '.join(names[:3])})")
        chosen.update(found)
    return [name for name in names if name in chosen]


def unfreeze(lm: nn.Module, names: Sequence[str]) -> int:
    """Make the named weights trainable (the rest keep their state); returns how many elements train."""
    wanted = set(names)
    count = 0
    for name, param in lm.named_parameters():
        if name in wanted:
            param.requires_grad_(True)
            count += param.numel()
    return count


def trained_lm_state(lm: nn.Module) -> dict[str, torch.Tensor]:
    """The LM's trainable weights that are not LoRA's, by name (tied weights once)."""
    return {name: param.detach() for name, param in lm.named_parameters()
            if param.requires_grad and "lora_" not in name}


def save_lm_weights(state: dict[str, torch.Tensor], directory: Path) -> None:
    """``directory/model.safetensors`` holding ``state`` (contiguous CPU copies)."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(directory / WEIGHTS_NAME))


def load_lm_weights(lm: nn.Module, directory: Path, *, resume: bool = False) -> int:
    """Copy the weights saved by ``save_lm_weights`` into ``lm`` (names and shapes must match; a serving LM of
    another dtype takes them cast). ``resume``: exactly, so the dtype must match too, and a file that lacks one of
    ``lm``'s trainable weights is refused. Returns how many tensors were loaded."""
    path = directory / WEIGHTS_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no {WEIGHTS_NAME} (the LM weights a train_lm: full stage saves)")
    saved = load_file(str(path))
    params = dict(lm.named_parameters())
    unknown = sorted(set(saved) - set(params))
    if unknown:
        raise RuntimeError(f"{path}: weights {unknown[:5]} are not parameters of this LM")
    if resume:
        missing = sorted(set(trained_lm_state(lm)) - set(saved))
        if missing:
            raise RuntimeError(f"{path}: lacks the trainable weights {missing[:5]} (written with other "
                               f"train_lm_layers)")
    with torch.no_grad():
        for name, tensor in saved.items():
            param = params[name]
            if param.shape != tensor.shape or (resume and param.dtype != tensor.dtype):
                raise RuntimeError(f"{path}: {name} is {tuple(tensor.shape)} {tensor.dtype}; the model's is "
                                   f"{tuple(param.shape)} {param.dtype}")
            param.copy_(tensor)
    return len(saved)
