"""Activation checkpointing of an LM's decoder layers, all of them or those of chosen kinds (full attention, linear
attention, Mamba, MoE...): a checkpointed layer keeps only its input and recomputes its activations in backward."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer


class CheckpointingError(ValueError):
    """A recipe asks to checkpoint layer kinds the model does not have."""


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules transformers lets checkpoint (its ``GradientCheckpointingLayer``s: one per decoder layer)."""
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def layer_kind(layer: nn.Module) -> str:
    """What a decoder layer is: its ``block_type`` / ``layer_type`` (``full_attention``, ``linear_attention``,
    ``moe``, ``mlp``, ...), or ``decoder`` for a model with one kind of layer."""
    for attr in ("block_type", "layer_type"):
        kind = getattr(layer, attr, None)
        if isinstance(kind, str):
            return kind
    return "decoder"


def layer_kinds(model: nn.Module) -> list[str]:
    """The distinct layer kinds of ``model``, in first-seen order."""
    return list(dict.fromkeys(layer_kind(layer) for layer in decoder_layers(model)))


def checkpoint_layers(model: nn.Module, mode: str | Sequence[str], where: str = "activation_checkpointing") -> int:
    """Turn checkpointing on for ``mode``: ``off``, ``full`` or a list of layer kinds; returns how many layers it
    covers. A kind the model does not have is refused, naming ``where`` and the kinds it has."""
    layers = decoder_layers(model)
    if mode == "off":
        chosen: list[nn.Module] = []
    elif mode == "full":
        chosen = layers
    else:
        kinds = layer_kinds(model)
        unknown = [k for k in mode if k not in kinds]
        if unknown:
            raise CheckpointingError(f"{where}: layer kind(s) {unknown} are not in this model; expected some of "
                                     f"{kinds}, got {list(mode)}")
        chosen = [layer for layer in layers if layer_kind(layer) in mode]
    # non-reentrant: works with frozen inputs (LoRA on a frozen base) and keyword arguments
    run = functools.partial(checkpoint, use_reentrant=False)
    for layer in layers:
        on = layer in chosen
        layer.gradient_checkpointing = on
        if on:
            layer._gradient_checkpointing_func = run
    return len(chosen)

