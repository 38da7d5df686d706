"""Nemotron-H's Mamba-2 mixer on flash-linear-attention's Triton kernels, with sample boundaries.

Why: transformers runs the Mamba-2 scan on ``mamba_ssm`` + ``causal_conv1d`` CUDA builds or else on a PyTorch
reference that is several times slower and, at 4,096 tokens on a 4B shape, asks for 28–42 GiB blocks. Neither
CUDA package has a wheel for this stack. Mamba-2's state-space dual is exactly simple
gated linear attention with one scalar decay per head::

    h_t = exp(dt_t * A) h_{t-1} + (dt_t x_t) B_t^T        (state [head_dim, state_size] per head)
    y_t = h_t C_t + D x_t

so ``fla.ops.simple_gla.chunk_simple_gla`` with q = C, k = B, v = dt * x, g = dt * A, scale 1 computes the scan,
and ``fla.modules.causal_conv1d`` the depthwise convolution. Both take ``cu_seqlens``, so packed rows keep each
sample's state and conv window to itself, which the stock PyTorch path cannot do. The gated group RMSNorm after the
scan, ``norm(y * silu(gate))``, is fla's fused kernel (``rmsnorm_fn``, one launch each way): transformers' version
runs about ten fp32 elementwise kernels forward over a [tokens, heads x head_dim] tensor and more backward.

The same math runs on a PyTorch ``reference`` backend (per segment, quadratic in its length); the tests check it
against the stock mixer and against unpacked samples, and the GPU benchmark checks the fla backend against it.
Generation (any call with a cache) keeps the stock forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from stitch.accel import (
    decode_cache_kwargs,
    fla_conv,
    fla_seqlens,
    flatten_packed_rows,
    reference_conv,
    segments,
)

FLA = "fla"
REFERENCE = "reference"
# chunk length of a cached prefill (a rollout's prompt): transformers' PyTorch chunk scan, which a cached call takes
# without mamba_ssm, holds [rows, chunks, chunk, chunk, heads, state] products: at Nano-4B's chunk of 256 a GRPO
# prefill of 8 prompts asked for 72 GiB on an 80 GB GPU. Memory goes with the chunk; the scan is exact at any chunk
PREFILL_CHUNK = 32


# -- backends: conv(x [1|B, T, D], weight [D, W], bias, activation, cu_seqlens) -> [.., T, D]
#              scan(q, k [.., T, H, N], v [.., T, H, P], g [.., T, H] fp32, cu_seqlens) -> [.., T, H, P] -----------


def reference_scan(q, k, v, g, cu_seqlens):
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for s, e in segments(v.shape[1], cu_seqlens):
        cum = g[:, s:e].float().cumsum(1)  # [B, L, H]
        diff = cum[:, :, None, :] - cum[:, None, :, :]  # [B, i, j, H]
        causal = torch.ones(e - s, e - s, dtype=torch.bool, device=v.device).tril()[None, :, :, None]
        decay = torch.exp(diff.masked_fill(~causal, float("-inf")))
        scores = torch.einsum("bihn,bjhn->bijh", q[:, s:e].float(), k[:, s:e].float()) * decay
        out[:, s:e] = torch.einsum("bijh,bjhp->bihp", scores, v[:, s:e].float())
    return out


def fla_scan(q, k, v, g, cu_seqlens):
    from fla.ops.simple_gla import chunk_simple_gla  # optional: fla ([kernels] extra)

    o, _ = chunk_simple_gla(q, k, v, g=g, scale=1.0, **fla_seqlens(cu_seqlens))
    return o


def reference_norm(norm, y, gate):
    return norm(y, gate)


def fla_norm(norm, y, gate):
    """transformers' gated group RMSNorm ``norm(y, gate)`` (gate before the norm, fp32 math, output in ``y``'s
    dtype) as fla's fused kernel; a norm without the fields it reads keeps its own forward."""
    eps, group = getattr(norm, "variance_epsilon", None), getattr(norm, "group_size", None)
    if eps is None or group is None or getattr(norm, "bias", None) is not None:
        return reference_norm(norm, y, gate)
    from fla.modules.norm.layernorm_gated import rmsnorm_fn  # optional: fla ([kernels] extra)

    return rmsnorm_fn(y, norm.weight, None, z=gate, eps=eps, group_size=group, norm_before_gate=False)


# -- backends: conv, scan and the gated norm (norm module, y [.., T, D], gate [.., T, D]) -> [.., T, D]
BACKENDS: dict[str, tuple[Callable, Callable, Callable]] = {
    REFERENCE: (reference_conv, reference_scan, reference_norm),
    FLA: (fla_conv, fla_scan, fla_norm),
}


def mamba2_forward(mixer: Any, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   cu_seqlens: torch.Tensor | None = None, backend: str = FLA) -> torch.Tensor:
    """A NemotronH Mamba-2 mixer's no-cache forward; ``cu_seqlens`` keeps the samples of one packed row apart
    (packed batches arrive as one row: ``stitch.kernels.varlen.flatten_packed_rows``)."""
    conv, scan, norm = BACKENDS[backend]
    batch, seqlen, _ = hidden_states.shape
    if cu_seqlens is not None and batch != 1:
        raise ValueError(f"cu_seqlens needs one flattened row, got a batch of {batch} rows")
    dtype = hidden_states.dtype
    heads, head_dim, groups, state = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size
    if attention_mask is not None and attention_mask.dim() == 2:  # right padding: zero it as the stock path does
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(dtype)
    projected = mixer.in_proj(hidden_states)
    gate, xbc, dt = projected.split([mixer.intermediate_size, mixer.conv_dim, heads], dim=-1)
    xbc = conv(xbc.contiguous(), mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, mixer.activation, cu_seqlens)
    if attention_mask is not None and attention_mask.dim() == 2:
        xbc = (xbc * attention_mask[:, :, None]).to(dtype)
    x, b, c = xbc.split([mixer.intermediate_size, groups * state, groups * state], dim=-1)
    lo, hi = mixer.time_step_limit
    dt = F.softplus(dt.float() + mixer.dt_bias.float()).clamp(min=lo, max=hi)  # [B, T, H]
    g = dt * -torch.exp(mixer.A_log.float())  # log decay per head and step, <= 0
    x = x.reshape(batch, seqlen, heads, head_dim)
    b = b.reshape(batch, seqlen, groups, state).repeat_interleave(heads // groups, dim=2)
    c = c.reshape(batch, seqlen, groups, state).repeat_interleave(heads // groups, dim=2)
    v = (x.float() * dt[..., None]).to(x.dtype)
    y = scan(c, b, v, g, cu_seqlens).float() + mixer.D.float()[:, None] * x.float()
    y = norm(mixer.norm, y.reshape(batch, seqlen, -1), gate)
    return mixer.out_proj(y.to(dtype))


@functools.cache
def _mixer_class():
    from transformers.models.nemotron_h.modeling_nemotron_h import (
        NemotronHMamba2Mixer,  # deferred: plugin loading skips transformers
    )

    class KernelMamba2Mixer(NemotronHMamba2Mixer):
        """The stock mixer; without a cache its forward runs ``mamba2_forward`` on ``stitch_backend``; a cached
        prefill runs the stock forward in chunks of ``PREFILL_CHUNK``."""

        stitch_backend = FLA

        def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
            cu_seqlens = kwargs.get("cu_seq_lens_q")
            backend = self.stitch_backend
            if backend == FLA and not hidden_states.is_cuda:  # fla's kernels are Triton/CUDA only
                backend = REFERENCE if cu_seqlens is not None else None
            cached = decode_cache_kwargs(cache_params, kwargs)
            if cached is not None and hidden_states.shape[1] > 1 and self.chunk_size > PREFILL_CHUNK:
                full, self.chunk_size = self.chunk_size, PREFILL_CHUNK  # a prefill: the same scan in short chunks
                try:
                    return super().forward(hidden_states, attention_mask=attention_mask, **cached)
                finally:
                    self.chunk_size = full
            if cached is not None or backend is None:
                return super().forward(hidden_states, attention_mask=attention_mask, **(cached or kwargs))
            return mamba2_forward(self, hidden_states, attention_mask, cu_seqlens, backend=backend)

    return KernelMamba2Mixer


def use_varlen(model: torch.nn.Module, backend: str = FLA) -> int:
    """Packed calls of ``model`` (a NemotronH causal LM) keep every sample's Mamba-2 state and conv window apart:
    kernel mixers, plus packed rows flattened into one row carrying the sample starts. Returns the mixers swapped."""
    swapped = install_mamba2_kernels(model, backend)
    flatten_packed_rows(model.model)
    return swapped


def install_mamba2_kernels(model: torch.nn.Module, backend: str = FLA) -> int:
    """Swap every Mamba-2 mixer of ``model`` to the kernel forward; returns how many were swapped."""
    if backend not in BACKENDS:
        raise ValueError(f"Mamba-2 backend {backend!r}: expected one of {sorted(BACKENDS)}")
    from transformers.models.nemotron_h.modeling_nemotron_h import (
        NemotronHMamba2Mixer,  # deferred: plugin loading skips transformers
    )

    cls = _mixer_class()
    swapped = 0
    for module in model.modules():
        if isinstance(module, NemotronHMamba2Mixer):
            if not isinstance(module, cls):
                module.__class__ = cls
            module.stitch_backend = backend
            swapped += 1
    return swapped
