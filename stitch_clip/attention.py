"""``stitch_vit``: the CLIP tower's attention as one Triton kernel written for a ViT's short rows.

Why: ViT-B/32 attends 50 tokens in 12 heads of 64. On a Hopper GPU torch's sdpa (cuDNN's kernel, its pick) takes
3-4x the time the layers' query, key, value and output rows need in HBM traffic: kernels tiled for long sequences
spend most of their time on padding and set-up. CUTLASS's memory-efficient kernel is faster but gives an image other
bits in another batch size; this kernel computes each image alone, so prepare's batches and serving's single images
get the same features.

Where the kernel cannot run (a CPU, fp32, a mask, dropout, rows longer than ``MAX_TOKENS``, a head width Triton's
dot does not take, no Triton) the call is transformers' own sdpa, unchanged.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from typing import Any

import torch

NAME = "stitch_vit"
MAX_TOKENS = 128  # one program holds a head's [tokens x tokens] scores in registers
# heads per program and warps per program: fixed (not autotuned) so every run of every batch size launches the same
# kernel
LAUNCH = {"heads": 1, "num_warps": 4}
# looked up once at import, not in ``kernel_usable``: a compiled tower traces that function, and dynamo warns about
# (and traces through) a cached function
TRITON = importlib.util.find_spec("triton") is not None


def kernel_usable(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                  dropout: float) -> bool:
    """Whether ``vit_attention`` runs this call: CUDA tensors in half precision, no mask, no dropout, equal
    query/key/value shapes, rows of at most ``MAX_TOKENS``, a head width of 16 to 128 (a power of 2), Triton
    installed. (The tests call ``vit_attention`` itself on CPU tensors under Triton's interpreter.)"""
    *_, s, d = query.shape
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and attention_mask is None
            and dropout == 0.0 and key.shape == value.shape == query.shape and s <= MAX_TOKENS
            and d in (16, 32, 64, 128) and key.dtype == value.dtype == query.dtype and TRITON)


@torch.library.custom_op("stitch_clip::vit_attention", mutates_args=())
def vit_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q kᵀ · scale) v over whole rows: [batch, heads, tokens, dim] in (any strides with a unit last
    stride: the projections' views), [batch, tokens, heads, dim] out, contiguous."""
    import triton  # optional: triton (CUDA torch)

    from stitch_clip._vit_attention_kernel import vit_attention_kernel  # optional: triton (a Triton kernel)

    b, h, s, d = query.shape
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    out = query.new_empty((b, s, h, d))
    heads = LAUNCH["heads"] if h % LAUNCH["heads"] == 0 else 1
    if b and s:
        vit_attention_kernel[(b * (h // heads),)](
            query, key, value, out,
            query.stride(0), query.stride(1), query.stride(2),
            key.stride(0), key.stride(1), key.stride(2),
            value.stride(0), value.stride(1), value.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            h, s, scale * math.log2(math.e),
            BLOCK=max(16, triton.next_power_of_2(s)), DIM=d, HEADS=heads, num_warps=LAUNCH["num_warps"],
        )
    return out


@vit_attention.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    b, h, s, d = query.shape
    return query.new_empty((b, s, h, d))


def stitch_vit_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                         **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention interface: [B, H, S, D] query/key/value -> ([B, S, H, D] output, no weights)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if kernel_usable(query, key, value, attention_mask, dropout):
        return torch.ops.stitch_clip.vit_attention(query, key, value, float(scale)), None
    from transformers.integrations.sdpa_attention import (
        sdpa_attention_forward,  # deferred: plugin loading skips transformers
    )

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


@functools.cache
def register() -> str:
    """Register ``stitch_vit`` with transformers' attention interface (once); returns its name."""
    from transformers import AttentionInterface  # deferred: plugin loading skips transformers

    AttentionInterface.register(NAME, stitch_vit_attention)
    return NAME
