"""Qwen kernels: Qwen3.5 / Qwen3.6 Gated DeltaNet packed with sample boundaries, and liger-kernel's fused RMSNorm,
SwiGLU and RoPE on GPU tensors (``use_fused_kernels``, at the end).

transformers already hands ``cu_seq_lens_q`` to the Gated DeltaNet rule (fla's varlen ``chunk_gated_delta_rule``
when fla is installed), but its short causal conv ignores it, and fla's varlen kernels take one flattened row.
stitch closes both gaps: ``use_varlen`` flattens packed rows into one row carrying the sample starts
(``stitch.model.varlen.flatten_packed_rows``) and wraps the two module-level functions the layer calls so that, given
the starts, the conv restarts at each sample (fla's varlen conv on a GPU) and, off the GPU, the rule runs sample by
sample on transformers' own PyTorch code. Without starts both wrappers call the original unchanged.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Any

import torch

from stitch.api import (
    fla_conv,
    fla_kernels_importable,
    fla_seqlens,
    flatten_packed_rows,
    reference_conv,
    segments,
)

log = logging.getLogger("stitch")

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
        if cu_seqlens is None:
            return original(query, key, value, g, beta, *args, cu_seqlens=None, **kwargs)
        if _on_fla(query):  # fla's kernel takes the starts itself: int64, with the host copy that spares its sync
            return original(query, key, value, g, beta, *args, **fla_seqlens(cu_seqlens), **kwargs)
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


# -- liger-kernel's fused RMSNorm / SwiGLU / RoPE on the model instance ------------------------------------------
#
# Each RMSNorm costs ~7 elementwise kernels forward (fp32 upcast, square, mean, rsqrt, two products, downcast) and
# more backward, a SwiGLU two plus its backward, RoPE's rotate-half ~5 per tensor: with 4 norms, one MLP and one RoPE
# a layer that is thousands of small launches per training step. liger's Triton kernels do each in one. The modules
# are switched by class (deep-copy safe, as stitch.model.precision does), and every switched forward runs the
# original PyTorch code on any tensor that is not on a GPU, so CPU runs and tests keep the reference path.

# RMSNorm class -> (liger offset, liger casting mode) that reproduce its math: Qwen3 is Llama's (weight * x.to(dtype)),
# Qwen3.5 is Gemma's ((1 + weight) in fp32, cast last)
FUSED_NORMS = {"Qwen3RMSNorm": (0.0, "llama"), "Qwen3_5RMSNorm": (1.0, "gemma"), "Qwen3_5MoeRMSNorm": (1.0, "gemma")}
FUSED_MLPS = ("Qwen3MLP", "Qwen3_5MLP", "Qwen3_5MoeMLP")  # down(silu(gate(x)) * up(x))
# modules whose apply_rotary_pos_emb is the full-width rotate-half that liger's rope computes (Qwen3.5 rotates a
# part of each head with interleaved mrope sections: it keeps transformers' function)
FUSED_ROPE_MODULES = ("transformers.models.qwen3.modeling_qwen3",)


@functools.cache
def liger_functions() -> dict[str, Any] | None:
    """liger-kernel's functional RMSNorm, SiLU-mul and RoPE, or None where liger-kernel does not import."""
    try:
        from liger_kernel.transformers.functional import liger_rms_norm, liger_rope, liger_swiglu
    except Exception:  # not installed, or its Triton does not import on this machine
        return None
    return {"rms_norm": liger_rms_norm, "swiglu": liger_swiglu, "rope": liger_rope}


def fused_here(t: torch.Tensor) -> bool:
    """Whether a tensor goes through liger's kernels: on a GPU, with liger importable."""
    return t.is_cuda and liger_functions() is not None


class _FusedRMSNorm:
    """Mixed into an RMSNorm class: liger's one-kernel norm with the offset and casting mode of the original."""

    fused_offset: float
    fused_casting: str

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not fused_here(hidden_states):
            return super().forward(hidden_states)
        eps = getattr(self, "variance_epsilon", None) or getattr(self, "eps", 1e-6)
        return liger_functions()["rms_norm"](hidden_states, self.weight, eps, self.fused_offset, self.fused_casting,
                                             False)


class _FusedSwiGLU:
    """Mixed into a gate/up/down MLP with SiLU: one kernel for silu(gate) * up, forward and backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not fused_here(x):
            return super().forward(x)
        return self.down_proj(liger_functions()["swiglu"](self.gate_proj(x), self.up_proj(x)))


@functools.cache
def _fused_class(cls: type, mixin: type) -> type:
    fused = type(f"Fused{cls.__name__}", (mixin, cls), {})
    if mixin is _FusedRMSNorm:
        fused.fused_offset, fused.fused_casting = FUSED_NORMS[cls.__name__]
    return fused


def _rope(original: Any) -> Any:
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if not fused_here(q) or args or kwargs.get("position_ids") is not None:
            return original(q, k, cos, sin, *args, **kwargs)
        return liger_functions()["rope"](q, k, cos, sin, unsqueeze_dim=kwargs.get("unsqueeze_dim", 1))

    apply_rotary_pos_emb.stitch_original = original
    return apply_rotary_pos_emb


def patch_fused_rope() -> int:
    """Wrap apply_rotary_pos_emb of each full-width RoPE module once; returns how many modules are wrapped."""
    done = 0
    for name in FUSED_ROPE_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        current = getattr(module, "apply_rotary_pos_emb", None)
        if current is not None and not hasattr(current, "stitch_original"):
            module.apply_rotary_pos_emb = _rope(current)
        done += current is not None
    return done


def unpatch_fused_rope() -> None:
    """transformers' own apply_rotary_pos_emb again (stock comparisons)."""
    for name in FUSED_ROPE_MODULES:
        module = importlib.import_module(name)
        current = getattr(module, "apply_rotary_pos_emb", None)
        if hasattr(current, "stitch_original"):
            module.apply_rotary_pos_emb = current.stitch_original


def use_fused_kernels(model: Any) -> dict[str, int]:
    """Switch ``model``'s RMSNorms and SwiGLU MLPs to liger's kernels (and wrap RoPE) where liger imports; returns
    how many modules of each kind now run fused on GPU tensors (empty without liger). Idempotent."""
    if liger_functions() is None:
        return {}
    counts = {"rms_norm": 0, "swiglu": 0}
    for module in model.modules():
        cls = type(module)
        if cls.__name__ in FUSED_NORMS:
            module.__class__ = _fused_class(cls, _FusedRMSNorm)
        elif cls.__name__ in FUSED_MLPS and _silu(module):
            module.__class__ = _fused_class(cls, _FusedSwiGLU)
        counts["rms_norm"] += isinstance(module, _FusedRMSNorm)
        counts["swiglu"] += isinstance(module, _FusedSwiGLU)
    counts["rope_modules"] = patch_fused_rope()
    return counts


def restore_reference_kernels(model: Any) -> None:
    """Undo ``use_fused_kernels``: transformers' own modules and RoPE (the benchmark's stock mode)."""
    for module in model.modules():
        if isinstance(module, (_FusedRMSNorm, _FusedSwiGLU)):
            module.__class__ = type(module).__mro__[2]
    unpatch_fused_rope()


def install_fused_kernels(model: Any) -> bool:
    """``ModelSpec.install_sample_starts`` of the attention-only presets: the fused kernels, nothing for packing (they
    pack natively), so False."""
    counts = use_fused_kernels(model)
    if counts:
        log.info("%s: liger-kernel RMSNorm x%d, SwiGLU x%d on GPU tensors", type(model).__name__, counts["rms_norm"],
                 counts["swiglu"])
    return False


def _silu(mlp: Any) -> bool:
    act = getattr(getattr(mlp, "config", None), "hidden_act", None)
    return act in ("silu", "swish") and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
