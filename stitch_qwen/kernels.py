"""Qwen3.5 / Qwen3.6 Gated DeltaNet packed with sample boundaries.

transformers already hands ``cu_seq_lens_q`` to the Gated DeltaNet rule (fla's varlen ``chunk_gated_delta_rule``
when fla is installed), but its short causal conv ignores it, and fla's varlen kernels take one flattened row.
stitch closes both gaps: ``use_varlen`` flattens packed rows into one row carrying the sample starts
(``stitch.model.varlen.flatten_packed_rows``) and wraps the two module-level functions the layer calls so that, given
the starts, the conv restarts at each sample (fla's varlen conv on a GPU) and, off the GPU, the rule runs sample by
sample on transformers' own PyTorch code. Without starts both wrappers call the original unchanged.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from stitch.api import fla_conv, fla_kernels_importable, flatten_packed_rows, reference_conv, segments

MODULES = ("transformers.models.qwen3_5.modeling_qwen3_5", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")


def _on_fla(t: torch.Tensor) -> bool:
    return t.is_cuda and fla_kernels_importable() is None


def _conv(original: Any) -> Any:
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        cu = kwargs.get("cu_seq_lens_q")
        if cu is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        x = hidden_states.transpose(1, 2).contiguous()  # the layer passes [1, channels, tokens]
        conv = fla_conv if _on_fla(x) else reference_conv
        return conv(x, weight, bias, activation, cu).transpose(1, 2)

    causal_conv1d_fn.stitch_original = original
    return causal_conv1d_fn


def _rule(original: Any) -> Any:
    def torch_chunk_gated_delta_rule(query, key, value, g, beta, *args, cu_seqlens=None, **kwargs):
        if cu_seqlens is None or _on_fla(query):  # fla's kernel takes the starts itself
            return original(query, key, value, g, beta, *args, cu_seqlens=cu_seqlens, **kwargs)
        parts = [original(query[:, s:e], key[:, s:e], value[:, s:e], g[:, s:e], beta[:, s:e], *args, **kwargs)[0]
                 for s, e in segments(query.shape[1], cu_seqlens)]
        return torch.cat(parts, dim=1), None  # packed calls carry no cache, so no final state is asked for

    torch_chunk_gated_delta_rule.stitch_original = original
    return torch_chunk_gated_delta_rule


def patch_gated_deltanet() -> int:
    """Wrap the conv and the rule in each Qwen3.5 modeling module once; returns how many modules were wrapped."""
    done = 0
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for attr, wrap in (("causal_conv1d_fn", _conv), ("torch_chunk_gated_delta_rule", _rule)):
            current = getattr(module, attr, None)
            if current is None:  # transformers renamed what the layer calls: packing would leak, so refuse
                raise RuntimeError(f"{name} has no {attr}: stitch cannot pass sample starts to Qwen3.5's Gated "
                                   f"DeltaNet with this transformers version")
            if not hasattr(current, "stitch_original"):
                setattr(module, attr, wrap(current))
        done += 1
    return done


def use_varlen(model: Any) -> None:
    """Packed calls of ``model`` (a Qwen3.5 causal LM) keep every sample's recurrent state and conv window apart."""
    patch_gated_deltanet()
    flatten_packed_rows(model.model)
