"""Qwen kernels: Qwen3.5 / Qwen3.6 Gated DeltaNet packed with sample boundaries, and liger-kernel's fused RMSNorm,
SwiGLU and RoPE on GPU tensors (``use_fused_kernels``, at the end).

transformers already hands ``cu_seq_lens_q`` to the Gated DeltaNet rule (fla's varlen ``chunk_gated_delta_rule``
when fla is installed), but its short causal conv ignores it, and fla's varlen kernels take one flattened row.
stitch closes both gaps: ``use_varlen`` flattens packed rows into one row carrying the sample starts
(``stitch.kernels.varlen.flatten_packed_rows``) and wraps the two module-level functions the layer calls so that, given
the starts, the conv restarts at each sample (fla's varlen conv on a GPU) and, off the GPU, the rule runs sample by
sample on transformers' own PyTorch code. Without starts both wrappers call the original unchanged.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from collections.abc import Iterator
from typing import Any

import torch

from stitch.accel import (
    decode_cache_kwargs,
    drop_graphs,
    fla_conv,
    fla_kernels_usable,
    fla_seqlens,
    flatten_packed_rows,
    reference_conv,
    segments,
    shared_input_projections,
    static_block,
)

log = logging.getLogger("stitch")

MODULES = ("transformers.models.qwen3_5.modeling_qwen3_5", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")


def _on_fla(t: torch.Tensor) -> bool:
    return t.is_cuda and fla_kernels_usable() is None


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
    if not getattr(original, "stitch_device_guard", False):
        original = _off_gpu_on_torch(original)

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


def imported(names: tuple[str, ...]) -> Iterator[Any]:
    """The modules named that import here (a transformers without one leaves it out)."""
    for name in names:
        try:
            yield importlib.import_module(name)
        except ImportError:
            continue


def patch_gated_deltanet() -> int:
    """Wrap the conv and the rule in each Qwen3.5 modeling module once; returns how many modules were wrapped."""
    done = 0
    for module in imported(MODULES):
        for attr, wrap in (("causal_conv1d_fn", _conv), ("torch_chunk_gated_delta_rule", _rule)):
            current = getattr(module, attr, None)
            if current is None:  # transformers renamed what the layer calls: packing would leak, so refuse
                raise RuntimeError(f"{module.__name__} has no {attr}: stitch cannot pass sample starts to Qwen3.5's Gated "
                                   f"DeltaNet with this transformers version")
            if not hasattr(current, "stitch_original"):
                setattr(module, attr, wrap(current))
        done += 1
    return done


def use_varlen(model: Any) -> None:
    """Packed calls of ``model`` (a Qwen3.5 causal LM) keep every sample's recurrent state and conv window apart."""
    patch_gated_deltanet()
    flatten_packed_rows(model.model)


RULES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")


def _off_gpu_on_torch(original: Any) -> Any:
    torch_rule = inspect.unwrap(original)  # transformers' PyTorch rule under its kernel-hub decorator

    @functools.wraps(original)
    def rule(query, *args, **kwargs):
        return (original if query.is_cuda else torch_rule)(query, *args, **kwargs)

    rule.stitch_device_guard = True
    return rule


def keep_rules_off_gpu_on_torch() -> int:
    """Tensors off the GPU take transformers' PyTorch Gated DeltaNet rules in each Qwen3.5 modeling module:
    transformers takes fla's Triton rules for every call once fla imports, and those fail on CPU tensors (a GPU
    machine's CPU tests, a model moved to the CPU). Returns the rules wrapped."""
    done = 0
    for module in imported(MODULES):
        for attr in RULES:
            current = getattr(module, attr, None)
            if current is not None and not getattr(current, "stitch_device_guard", False) \
                    and not hasattr(current, "stitch_original") and inspect.unwrap(current) is not current:
                setattr(module, attr, _off_gpu_on_torch(current))
                done += 1
    return done


def keep_reference_rule() -> int:
    """Run transformers' PyTorch Gated DeltaNet rule in each Qwen3.5 modeling module, not fla's, which transformers
    takes whenever fla imports: for a machine where fla's backward refuses the installed Triton (Hopper, Triton
    < 3.7.1), so training falls back instead of stopping at the first backward. Returns the modules changed."""
    done = 0
    for module in imported(MODULES):
        current = getattr(module, "torch_chunk_gated_delta_rule", None)
        if current is not None and not hasattr(current, "stitch_original"):
            # the PyTorch rule under transformers' kernel-hub decorator (itself when already unwrapped)
            module.torch_chunk_gated_delta_rule = inspect.unwrap(current)
            done += 1
    return done


# -- liger-kernel's fused RMSNorm / SwiGLU / RoPE on the model instance ------------------------------------------
#
# Each RMSNorm costs ~7 elementwise kernels forward (fp32 upcast, square, mean, rsqrt, two products, downcast) and
# more backward, a SwiGLU two plus its backward, RoPE's rotate-half ~5 per tensor: with 4 norms, one MLP and one RoPE
# a layer that is thousands of small launches per training step. liger's Triton kernels do each in one. The modules
# are switched by class (deep-copy safe, as stitch.kernels.precision does), and every switched forward runs the
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
        from liger_kernel.transformers.functional import (  # optional: liger-kernel ([kernels] extra)
            liger_rms_norm,
            liger_rope,
            liger_swiglu,
        )
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
    """Mixed into a gate/up/down MLP with SiLU: one kernel for silu(gate) * up, forward and backward; in a
    shape-static training step (packed rows) the whole block replays as a CUDA graph (``static_block``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not fused_here(x):
            return super().forward(x)
        return static_block(self, x, self.fused_forward)

    def fused_forward(self, x: torch.Tensor) -> torch.Tensor:
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
    for module in imported(FUSED_ROPE_MODULES):
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


# -- Qwen3.5's Gated DeltaNet as fla's kernels take it --------------------------------------------------------------
#
# transformers' layer, even on fla's chunk kernel, (1) repeats q and k from the key heads to the value heads
# (repeat_interleave 16 -> 32 at 4B: two copies forward, their reductions backward), (2) computes the decay
# -exp(A_log) * softplus(a + dt_bias) and sigmoid(b) in separate fp32 kernels, and (3) runs its gated RMSNorm as ~10
# elementwise fp32 kernels over [tokens x value heads, head dim], twice that backward. fla 0.6.0 does all three
# itself: value heads > key heads (GVA, value head j reads key head j // (HV / H): the repeat_interleave order), the
# decay and beta inside the chunk kernel (``use_gate_in_kernel``, ``use_beta_sigmoid_in_kernel``), and a one-kernel
# gated RMSNorm (``rms_norm_gated``, fp32 inside: transformers rounds the normalised value to bf16 before the weight,
# fla does not, a difference within bf16). The switched forward runs that on GPU tensors without a cache; anything
# else (CPU, decoding with a cache) runs transformers' own forward.
GATED_DELTANETS = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet")


@functools.cache
def fla_gdn_functions() -> dict[str, Any] | None:
    """fla's chunk rule, gated RMSNorm and causal conv, or None where fla's kernels do not import or refuse this
    machine's Triton."""
    if fla_kernels_usable() is not None:
        return None
    try:
        from fla.modules.norm.fused_norm_gate import rms_norm_gated  # optional: fla ([kernels] extra)
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # optional: fla ([kernels] extra)
    except Exception:  # an fla without them: transformers' layer stays
        return None
    return {"rule": chunk_gated_delta_rule, "norm": rms_norm_gated, "conv": fla_conv}


class _FusedGatedDeltaNet:
    """Mixed into a Qwen3.5 Gated DeltaNet: the same layer on fla's GVA rule, in-kernel gates and fused gated norm."""

    def forward(self, hidden_states: torch.Tensor, cache_params: Any = None, attention_mask: Any = None, **kwargs):
        fla = fla_gdn_functions() if _on_fla(hidden_states) else None
        cached = decode_cache_kwargs(cache_params, kwargs)
        if fla is None or cached is not None:
            return super().forward(hidden_states, attention_mask=attention_mask, **(cached or kwargs))
        if attention_mask is not None:  # transformers' apply_mask_to_padding_states: padding rows carry zeros
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        rows, width, _ = hidden_states.shape
        starts = kwargs.get("cu_seq_lens_q")  # stitch's packed calls (flatten_packed_rows); None otherwise
        # the four projections of one input: one autograd node when they are plain LoRA layers (their rank-r and
        # 32-wide products share one GEMM), the modules' own forwards otherwise; in a shape-static training step
        # one CUDA graph forward and one backward (static_block)
        projections = (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        mixed, gate, beta, decay = static_block(
            self, hidden_states, lambda h: tuple(shared_input_projections(h, projections)), projections)
        qkv = fla["conv"](mixed, self.conv1d.weight.squeeze(1), self.conv1d.bias, self.activation, starts)
        query, key, value = torch.split(qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        core, _ = fla["rule"](
            query.reshape(rows, width, -1, self.head_k_dim), key.reshape(rows, width, -1, self.head_k_dim),
            value.reshape(rows, width, -1, self.head_v_dim), decay, beta, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias, use_beta_sigmoid_in_kernel=True,
            **fla_seqlens(starts))

        def gated_norm_and_out(core: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
            normed = fla["norm"](core.reshape(-1, self.head_v_dim), gate.reshape(-1, self.head_v_dim),
                                 self.norm.weight, None, activation=self.norm.activation, eps=self.norm.variance_epsilon)
            return self.out_proj(normed.reshape(rows, width, -1))

        # keyed on the norm: out_proj, a LoRA layer, keys its own graph where it is called alone
        return static_block(self.norm, (core, gate), gated_norm_and_out, (self.norm, self.out_proj))


FUSED_MIXINS = (_FusedRMSNorm, _FusedSwiGLU, _FusedGatedDeltaNet)


def use_fused_kernels(model: Any) -> dict[str, int]:
    """Switch ``model``'s RMSNorms and SwiGLU MLPs to liger's kernels (and wrap RoPE) where liger imports, and its
    Gated DeltaNets to fla's fused path where fla imports; returns how many modules of each kind now run fused on
    GPU tensors (empty when neither imports). Idempotent."""
    liger, fla = liger_functions() is not None, fla_gdn_functions() is not None
    if not (liger or fla):
        return {}
    for module in model.modules():
        cls = type(module)
        if liger and cls.__name__ in FUSED_NORMS:
            module.__class__ = _fused_class(cls, _FusedRMSNorm)
        elif liger and cls.__name__ in FUSED_MLPS and _silu(module):
            module.__class__ = _fused_class(cls, _FusedSwiGLU)
        elif fla and cls.__name__ in GATED_DELTANETS:
            module.__class__ = _fused_class(cls, _FusedGatedDeltaNet)
    return {**fused_module_counts(model), "rope_modules": patch_fused_rope() if liger else 0}


FUSED_KINDS = {"rms_norm": _FusedRMSNorm, "swiglu": _FusedSwiGLU, "gated_deltanet": _FusedGatedDeltaNet}


def fused_module_counts(model: Any) -> dict[str, int]:
    """How many of ``model``'s modules run each fused kind now (what ``use_fused_kernels`` switched)."""
    counts = dict.fromkeys(FUSED_KINDS, 0)
    for module in model.modules():
        for kind, mixin in FUSED_KINDS.items():
            counts[kind] += isinstance(module, mixin)
    return counts


def restore_reference_kernels(model: Any, kinds: tuple[type, ...] = FUSED_MIXINS) -> None:
    """Undo ``use_fused_kernels`` (the stock model, a comparison's reference): transformers' own modules and RoPE;
    ``kinds`` limits it to some of the switched module kinds (RoPE is restored with the norms)."""
    drop_graphs(model)
    for module in model.modules():
        if isinstance(module, kinds):
            module.__class__ = type(module).__mro__[2]
    if _FusedRMSNorm in kinds:
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
