"""``stitch_varlen``: a transformers attention implementation that, for packed rows, attends within each sample only.

Packed rows cost Σsᵢ² instead of the row length squared: on CUDA through ``torch.nn.attention.varlen.varlen_attn``
(flash attention over one flattened row with the sample starts), elsewhere through causal SDPA run sample by sample.
Every other call (padded batches, generation with a cache) is transformers' own SDPA with its usual mask, except a
grouped-query decode step, which reads the shared kv heads without repeating them (same result).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F


def causal_lm(lm: Any) -> Any:
    """The transformers model inside a peft wrapper (``get_base_model``), or ``lm`` itself when it has none."""
    return lm.get_base_model() if hasattr(lm, "get_base_model") else lm


def cache_kwarg(lm: Any) -> str:
    """The keyword a causal LM's forward takes its cache by: ``cache`` where transformers renamed it (newer
    releases warn on ``past_key_values``), else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(type(causal_lm(lm)).forward).parameters else "past_key_values"


log = logging.getLogger("stitch")

NAME = "stitch_varlen"
# implementations stitch replaces by NAME: their unpacked calls are SDPA with the same mask, the packed ones exact
REPLACES = ("sdpa", "eager")

# set while StitchedModel runs a packed call: the mask builder then skips the [rows, 1, T, T] block-causal mask,
# and an attention layer that was not handed the sample starts refuses instead of attending across samples
_PACKED_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar("stitch_packed_call", default=False)


@contextlib.contextmanager
def packed_call() -> Iterator[None]:
    """Mark the LM call inside as packed: every attention layer gets ``cu_seq_lens_q`` through its kwargs."""
    token = _PACKED_CALL.set(True)
    try:
        yield
    finally:
        _PACKED_CALL.reset(token)


_NATIVE_GQA: dict[str, bool | None] = {"ok": None}  # whether this torch's varlen_attn took fewer kv heads


@functools.cache
def _varlen_attn() -> tuple[Callable | None, bool]:
    """torch's varlen flash attention (None where this torch has none) and whether it takes ``enable_gqa``."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # optional: torch builds without varlen
    except ImportError:
        return None, False
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


def flash_varlen_usable(query: torch.Tensor, dropout: float) -> bool:
    """Whether the CUDA varlen kernel can run this call (flash attention: CUDA, half precision, no dropout)."""
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and dropout == 0.0
            and query.shape[-1] <= 256 and _varlen_attn()[0] is not None)


def attend_per_sample(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                      scaling: float | None, dropout: float = 0.0) -> torch.Tensor:
    """Causal SDPA of each sample on its own. q [1, H, N, D], k/v [1, Hkv, N, D] -> [1, H, N, D]."""
    bounds = cu_seqlens.tolist()
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each kv head serves ``groups`` query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    parts = [F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True,
                                            scale=scaling, dropout_p=dropout)
             for s, e in zip(bounds[:-1], bounds[1:], strict=True) if e > s]
    return torch.cat(parts, dim=2)


def attend_flash_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                        longest: int, scaling: float | None) -> torch.Tensor:
    """torch's varlen flash attention, causal within each sample. q [1, H, N, D], k/v [1, Hkv, N, D] -> [1, H, N, D]."""
    varlen_attn, takes_gqa = _varlen_attn()
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [N, heads, D]
    groups = q.shape[1] // k.shape[1]
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)

    def call(k: torch.Tensor, v: torch.Tensor, **extra: Any) -> torch.Tensor:
        return varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling, window_size=(-1, 0), **extra)

    if groups == 1:
        out = call(k, v)
    elif takes_gqa:
        out = call(k, v, enable_gqa=True)
    else:
        # torch 2.11's wrapper has no enable_gqa; its flash kernel shares kv heads natively (head h reads kv head
        # h // groups, as repeat_interleave lays them out). Where a build refuses, the heads are repeated.
        out = None
        if _NATIVE_GQA["ok"] is not False:
            try:
                out = call(k, v)
                _NATIVE_GQA["ok"] = True
            except (RuntimeError, ValueError):
                _NATIVE_GQA["ok"] = False
        if out is None:
            out = call(k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1))
    return out.transpose(0, 1).unsqueeze(0)


def grouped_decode_applies(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, dropout: float) -> bool:
    """A decode step (one query token per row) of grouped-query attention under a boolean key mask."""
    return (query.shape[2] == 1 and key.shape[1] < query.shape[1] and query.shape[1] % key.shape[1] == 0
            and mask is not None and mask.dtype == torch.bool and mask.shape[2] == 1 and dropout == 0.0)


def grouped_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                             scaling: float | None) -> torch.Tensor:
    """One query token per row, q [B, H, 1, D], k/v [B, Hkv, L, D], mask [B, 1, 1, L] -> [B, 1, H, D].

    The query heads that share a kv head attend as that head's query rows, so each key is read once: transformers'
    SDPA path repeats k/v to every query head first (a full copy of the cache per layer and step)."""
    rows, heads, _, dim = query.shape
    kv = key.shape[1]
    grouped = query.reshape(rows, kv, heads // kv, dim)  # head h reads kv head h // (heads // kv), as repeat_kv
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(rows, heads, 1, dim).transpose(1, 2).contiguous()


def stitch_varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention interface: q [B, H, T, D], k/v [B, Hkv, T, D] -> ([B, T, H, D], None)."""
    from transformers.integrations.sdpa_attention import (
        sdpa_attention_forward,  # deferred: plugin loading skips transformers
    )

    cu = kwargs.get("cu_seq_lens_q")
    packed = cu is not None and attention_mask is None and query.shape[2] == key.shape[2]
    if grouped_decode_applies(query, key, attention_mask, dropout):
        return grouped_decode_attention(query, key, value, attention_mask, scaling), None
    if not packed or not getattr(module, "is_causal", True):
        if _PACKED_CALL.get() and attention_mask is None and query.shape[2] > 1:
            raise RuntimeError(
                f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) got a packed call without "
                f"cu_seq_lens_q: its model does not pass attention kwargs through, so {NAME} cannot keep samples "
                f"apart; load the LM with attn_implementation='sdpa' and without StitchedModel's packed path")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    rows, heads, width, dim = query.shape
    if not cu.is_cuda and int(cu[-1]) != rows * width:  # on CUDA this check would sync every layer
        raise ValueError(f"cu_seq_lens_q ends at {int(cu[-1])} but the call has {rows} rows x {width} tokens")
    if rows > 1:  # one flattened row; every row starts a sample, so nothing joins
        query, key, value = (t.transpose(0, 1).reshape(1, t.shape[1], rows * width, dim) for t in (query, key, value))
    if flash_varlen_usable(query, dropout):
        longest = kwargs.get("max_length_q") or int((cu[1:] - cu[:-1]).max())
        out = attend_flash_varlen(query, key, value, cu, int(longest), scaling)
    else:
        out = attend_per_sample(query, key, value, cu, scaling, dropout)
    # [1, H, rows*width, D] -> [rows, width, H, D]
    return out.transpose(1, 2).reshape(rows, width, heads, dim).contiguous(), None


def stitch_varlen_mask(*args: Any, **kwargs: Any) -> Any:
    """transformers mask interface: no mask for a packed call (the attention keeps samples apart), SDPA's otherwise."""
    from transformers.masking_utils import sdpa_mask  # deferred: plugin loading skips transformers

    if _PACKED_CALL.get() and kwargs.get("attention_mask") is None:
        return None
    return sdpa_mask(*args, **kwargs)


@functools.cache
def register() -> str:
    """Register ``stitch_varlen`` with transformers' attention and mask interfaces (once); returns its name."""
    from transformers import AttentionInterface  # deferred: plugin loading skips transformers
    from transformers.masking_utils import (
        AttentionMaskInterface,  # deferred: plugin loading skips transformers
    )

    AttentionInterface.register(NAME, stitch_varlen_attention)
    AttentionMaskInterface.register(NAME, stitch_varlen_mask)
    _skip_sample_detection_in_packed_calls()
    return NAME


def _skip_sample_detection_in_packed_calls() -> None:
    """transformers looks for packed samples in the position ids before it calls the mask interface, and that
    look reads the device (a sync per mask, per forward). In a packed call stitch's mask interface returns no mask
    and the attention takes the sample starts StitchedModel hands it, so the look is skipped there."""
    from transformers import masking_utils  # deferred: plugin loading skips transformers

    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None or getattr(original, "_stitch_skips_packed_calls", False):
        return

    @functools.wraps(original)
    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        return None if _PACKED_CALL.get() else original(position_ids)

    find_packed_sequence_indices._stitch_skips_packed_calls = True
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices


def use_varlen_attention(lm: torch.nn.Module) -> bool:
    """Switch ``lm`` (a transformers model, or a peft model around one) to ``stitch_varlen`` when it runs SDPA or
    eager attention; returns whether it runs ``stitch_varlen`` now. Flash/flex choices are left as they are."""
    base = causal_lm(lm)
    config = getattr(base, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current == NAME:
        return True
    if current not in REPLACES or not hasattr(base, "set_attn_implementation"):
        return False
    try:
        base.set_attn_implementation(register())
    except (ValueError, ImportError, AttributeError) as exc:  # a transformers that refuses custom implementations
        log.warning("packed rows keep the %s block mask: transformers refused attention %r (%s)", current, NAME, exc)
        return False
    return True


def runs_varlen_attention(lm: torch.nn.Module) -> bool:
    base = causal_lm(lm)
    return getattr(getattr(base, "config", None), "_attn_implementation", None) == NAME
