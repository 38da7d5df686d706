"""Next-token cross-entropy from hidden states without a [tokens, vocab] fp32 logits tensor.

The LM head and the loss run over chunks of tokens; the gradient of each chunk is computed in the forward pass
(the fused linear cross-entropy trick), so at most one chunk of logits is alive. liger-kernel's fused kernel runs
instead on CUDA where it is installed.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

# tokens per chunk: 4,096 x 151,936 fp32 logits are 2.3 GiB; a 1,024-token chunk is a quarter of that
CHUNK_TOKENS = 1024


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Summed CE of ``hidden @ weight.T (+ bias)`` against ``target``, logits in fp32 one chunk at a time."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                target: torch.Tensor, ignore_index: int, chunk: int) -> torch.Tensor:
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start:start + chunk]
            t = target[start:start + chunk]
            keep = t != ignore_index
            # the same logits as the reference: the head in the model's dtype, then fp32
            logits = F.linear(h, weight, bias).float()
            lse = torch.logsumexp(logits, dim=-1)
            index = t.clamp_min(0)[:, None]  # ignored rows pick any logit and are masked out
            total += ((lse - logits.gather(1, index).squeeze(1)) * keep).sum()
            if grad_h is None and grad_w is None and grad_b is None:
                continue
            # d(sum CE)/d logits = softmax - one_hot, zero on ignored rows, cast as autograd casts it (to the head's
            # output dtype) before the head's backward. The softmax overwrites the logits (one fp32 chunk alive),
            # and no boolean indexing (it would sync with a GPU every chunk).
            grad = logits.sub_(lse[:, None]).exp_()
            grad.scatter_add_(1, index, torch.full_like(grad[:, :1], -1.0))
            grad = grad.mul_(keep[:, None]).to(h.dtype)
            if grad_h is not None:
                grad_h[start:start + chunk] = grad @ weight
            if grad_w is not None:
                grad_w += (grad.t() @ h).float()
            if grad_b is not None:
                grad_b += grad.float().sum(0)
            del logits, grad
        ctx.save_for_backward(*(g if g is not None else torch.empty(0) for g in (grad_h, grad_w, grad_b)))
        ctx.has = (grad_h is not None, grad_w is not None, grad_b is not None)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        grad_h, grad_w, grad_b = ctx.saved_tensors
        has_h, has_w, has_b = ctx.has
        scale = grad_out.float()
        out_h = (grad_h.float() * scale).to(grad_h.dtype) if has_h else None
        out_w = (grad_w * scale).to(ctx.dtypes[0]) if has_w else None
        out_b = (grad_b * scale).to(ctx.dtypes[1]) if has_b else None
        return out_h, out_w, out_b, None, None, None


def liger_chunk_budget(tokens: int, hidden: int, vocab: int, rows: int | None = None) -> int:
    """liger's ``chunk_mem_const`` for chunks of about ``rows`` tokens (default ``CHUNK_TOKENS``).

    liger sizes a chunk so that its logits take ``chunk_mem_const`` times the hidden states' memory: at its default
    of 1 that is ``tokens / ceil(vocab / hidden)`` rows, 32 for Qwen3.5's 248,320-word vocabulary at ~2,000
    labelled tokens, and each chunk is then a skinny GEMM over the whole vocabulary: on a Hopper GPU those 62 calls
    a step run on 32-wide cuBLAS tiles, about a fifth of a packed Qwen3.5-4B step. This budget
    asks for chunks of ``rows`` instead (liger rounds to a power of two), the same size as the chunked path's."""
    rows = CHUNK_TOKENS if rows is None else rows
    return max(1, -(-vocab * min(rows, tokens) // (hidden * max(tokens, 1))))


# liger's chunk rows (``liger_chunk_budget``); None keeps liger's own default budget
LIGER_CHUNK_TOKENS: int | None = CHUNK_TOKENS


@functools.cache
def _liger_function() -> Any:
    """liger's autograd function when it takes a chunk budget (``chunk_mem_const``, liger >= 0.8.5), else None."""
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyFunction,  # optional: liger-kernel ([kernels] extra)
        )
    except Exception:  # noqa: BLE001 - a liger without it uses its module and its own budget
        return None
    params = list(inspect.signature(LigerFusedLinearCrossEntropyFunction.forward).parameters)
    return LigerFusedLinearCrossEntropyFunction if params[18:19] == ["chunk_mem_const"] else None  # after ctx


@functools.cache
def _liger_loss() -> Any:
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    try:
        from liger_kernel.transformers import (
            LigerFusedLinearCrossEntropyLoss,  # optional: liger-kernel ([kernels] extra)
        )
    except Exception:  # noqa: BLE001 - an installed but broken liger falls back to the chunked path
        return None
    return LigerFusedLinearCrossEntropyLoss(ignore_index=-100, reduction="sum")


def uses_liger(hidden: torch.Tensor) -> bool:
    """Whether ``linear_cross_entropy`` runs liger-kernel's fused kernel for these hidden states."""
    return hidden.is_cuda and _liger_loss() is not None


def linear_cross_entropy(hidden: torch.Tensor, head: torch.nn.Linear, target: torch.Tensor,
                         chunk: int | None = None) -> torch.Tensor:
    """Summed CE of ``head(hidden)`` (hidden [N, H], target [N], -100 ignored) in fp32, never holding all logits."""
    if uses_liger(hidden):
        function = _liger_function()
        if function is not None and LIGER_CHUNK_TOKENS is not None:
            budget = liger_chunk_budget(hidden.shape[0], hidden.shape[1], head.weight.shape[0], LIGER_CHUNK_TOKENS)
            # (input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction,
            #  softcap, return_z_loss, accum_dtype, use_token_scaling, return_token_accuracy,
            #  return_predicted_tokens, ce_impl, ce_mode, chunk_mem_const)
            out = function.apply(hidden, head.weight, target, head.bias, None, -100, 0.0, 0.0, "sum", None, False,
                                 None, False, False, False, None, None, budget)
        else:
            out = _liger_loss()(head.weight, hidden, target, head.bias)
        return (out[0] if isinstance(out, tuple) else out).float()
    return ChunkedLinearCrossEntropy.apply(hidden, head.weight, head.bias, target, -100, chunk or CHUNK_TOKENS)


class ChunkedLinearLogprobs(torch.autograd.Function):
    """Per-token log-probs of ``target`` under ``softmax(mask(hidden @ weight.T (+ bias)) / temperature)`` in fp32,
    one chunk of logits at a time; the backward recomputes each chunk's logits (one more head GEMM per chunk) instead
    of keeping them, so at most one [chunk, vocab] fp32 tensor is alive in either pass."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                target: torch.Tensor, temperature: float, suppress: torch.Tensor | None, chunk: int) -> torch.Tensor:
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lses = torch.empty_like(out)
        for start in range(0, hidden.shape[0], chunk):
            z = _scaled_logits(hidden[start:start + chunk], weight, bias, temperature, suppress)
            lse = torch.logsumexp(z, dim=-1)
            lses[start:start + chunk] = lse
            out[start:start + chunk] = z.gather(1, target[start:start + chunk, None]).squeeze(1) - lse
            del z
        ctx.save_for_backward(hidden, weight, bias, target, lses, suppress)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        hidden, weight, bias, target, lses, suppress = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[start:start + ctx.chunk]
            t = target[start:start + ctx.chunk, None]
            # d lp / d z = one_hot - softmax; z = logits / temperature
            z = _scaled_logits(h, weight, bias, ctx.temperature, suppress)
            grad = z.sub_(lses[start:start + ctx.chunk, None]).exp_().neg_()
            grad.scatter_add_(1, t, torch.ones_like(grad[:, :1]))
            if suppress is not None:  # a suppressed target (log-prob -inf) sends nothing back, as masked_fill's backward
                grad.index_fill_(1, suppress, 0.0)
            grad = grad.mul_(grad_out[start:start + ctx.chunk, None].float() / ctx.temperature).to(h.dtype)
            if grad_h is not None:
                grad_h[start:start + ctx.chunk] = grad @ weight
            if grad_w is not None:
                grad_w += (grad.t() @ h).float()
            if grad_b is not None:
                grad_b += grad.float().sum(0)
            del z, grad
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None)


def _scaled_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float,
                   suppress: torch.Tensor | None) -> torch.Tensor:
    """fp32 logits of one chunk as the full-logits path computes them: the head in the model's dtype, then fp32,
    suppressed ids at -inf, divided by the temperature."""
    z = F.linear(h, weight, bias).float()
    if suppress is not None:
        z.index_fill_(1, suppress, float("-inf"))
    return z.div_(temperature) if temperature != 1.0 else z


@functools.lru_cache(maxsize=16)
def _id_tensor(ids: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The suppressed ids on ``device``, copied there once (a copy from a Python list waits for the device); a normal
    tensor even when first asked for under ``inference_mode`` (autograd cannot save an inference tensor)."""
    with torch.inference_mode(False):
        return torch.tensor(ids, dtype=torch.long, device=device)


def _suppressed(suppress_ids: Sequence[int], device: torch.device) -> torch.Tensor | None:
    """``suppress_ids`` as a cached id tensor on ``device`` (``_id_tensor``), or None when there are none."""
    return _id_tensor(tuple(sorted(set(suppress_ids))), device) if suppress_ids else None


def linear_token_logprobs(hidden: torch.Tensor, head: torch.nn.Linear, target: torch.Tensor, temperature: float = 1.0,
                          suppress_ids: Sequence[int] = (), chunk: int | None = None) -> torch.Tensor:
    """fp32 log-prob of each ``target`` (hidden [N, H], target [N], ids >= 0) under ``head(hidden)`` with
    ``suppress_ids`` at -inf and ``temperature`` applied, never holding more than one chunk of logits."""
    return ChunkedLinearLogprobs.apply(hidden, head.weight, head.bias, target, float(temperature),
                                       _suppressed(suppress_ids, hidden.device), chunk or CHUNK_TOKENS)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                         suppress_ids: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 log-prob of each next label token [rows, length - 1], 0 where unlabelled; the label mask) from full
    logits [rows, length, vocab], ``suppress_ids`` at -inf and ``temperature`` applied: the path for models whose
    logits are more than ``head(hidden)``. Off the labels the gather reads id 0, -inf where that id is suppressed:
    those positions are zeroed, not multiplied by the mask (which would give NaN)."""
    z = logits[:, :-1].float()
    suppress = _suppressed(suppress_ids, z.device)
    if suppress is not None:
        z = z.index_fill(-1, suppress, float("-inf"))
    target = labels[:, 1:]
    mask = target != -100
    lp = torch.log_softmax(z / temperature, dim=-1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(mask, lp, 0.0), mask
