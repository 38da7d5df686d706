"""Half-precision compute with fp32 master weights for the trainable parts (LoRA adapter, projector).

With a bf16/fp16 LM, peft keeps LoRA weights in fp32 and casts every activation to fp32 for the adapter's products.
Here the weights stay fp32 parameters (what the optimizer steps and keeps its state for, what adapters save), and
each product casts the small weight to the activation's dtype instead, so the GEMMs and activations stay in half
precision and gradients reach the fp32 weights through the cast (the usual mixed-precision recipe).

A plain LoRA layer (one active adapter, no dropout, no variant) computes base + scaled adapter product as one autograd
node (``LoRAProduct``): peft's path is ~7 dispatched ops and autograd nodes forward and ~12 backward per layer, and a
packed 4B step with 144 LoRA layers spends more time launching them than running them.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

HALF = (torch.bfloat16, torch.float16)


class HalfComputeLinear(nn.Linear):
    """``nn.Linear`` whose (fp32 master) weight and bias are cast to the input's dtype for the product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        bias = None if self.bias is None or self.bias.dtype == x.dtype else self.bias.to(x.dtype)
        return F.linear(x, weight, self.bias if bias is None else bias)


class LoRAProduct(torch.autograd.Function):
    """``x W^T + b + s (x A^T) B^T`` with the frozen base weight ``W`` and the adapter's ``A``, ``B`` cast to ``x``'s
    dtype; gradients for ``x``, ``A`` and ``B`` (in their own dtypes), none for the frozen ``W`` and ``b``."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling):  # noqa: ANN001, ANN205 - autograd's signature
        a, b = lora_a.to(x.dtype), lora_b.to(x.dtype)
        flat = x.reshape(-1, x.shape[-1])
        low = flat @ a.t()
        out = flat @ weight.t() if bias is None else torch.addmm(bias.to(x.dtype), flat, weight.t())
        out.addmm_(low, b.t(), alpha=scaling)
        ctx.save_for_backward(flat, weight, a, b, low)
        ctx.scaling, ctx.shape, ctx.dtypes = scaling, x.shape, (lora_a.dtype, lora_b.dtype)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        flat, weight, a, b, low = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        g_low = (g @ b).mul_(ctx.scaling)
        grad_x = (g @ weight).addmm_(g_low, a).reshape(ctx.shape) if ctx.needs_input_grad[0] else None
        grad_a = (g_low.t() @ flat).to(ctx.dtypes[0]) if ctx.needs_input_grad[3] else None
        grad_b = (g.t() @ low).mul_(ctx.scaling).to(ctx.dtypes[1]) if ctx.needs_input_grad[4] else None
        return grad_x, None, None, grad_a, grad_b, None


class _OneNodeLoRA:
    """Mixed into peft's ``lora.Linear``: plain LoRA through ``LoRAProduct``; anything else through peft."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        name = self.active_adapters[0] if len(self.active_adapters) == 1 else None
        base = self.base_layer
        plain = (not args and not kwargs and name is not None and not self.disable_adapters and not self.merged
                 and name in self.lora_A and name not in getattr(self, "lora_variant", {})
                 and (not self.training or isinstance(self.lora_dropout[name], nn.Identity))
                 and type(base) is nn.Linear and not base.weight.requires_grad
                 and (base.bias is None or not base.bias.requires_grad))
        if not plain:
            return super().forward(x, *args, **kwargs)
        return LoRAProduct.apply(x, base.weight, base.bias, self.lora_A[name].weight, self.lora_B[name].weight,
                                 self.scaling[name])


def _peft_lora_linear() -> type:
    from peft.tuners.lora.layer import Linear

    return Linear


@functools.cache
def _one_node_class(cls: type) -> type:
    return type(cls.__name__, (_OneNodeLoRA, cls), {})


def restore_peft_lora(lm: nn.Module) -> None:
    """Undo ``lora_in_half_compute``: peft's own adapter compute (fp32 weights, activations cast to them)."""
    for module in lm.modules():
        if isinstance(module, _OneNodeLoRA):
            module.__class__ = type(module).__mro__[2]
        if isinstance(module, HalfComputeLinear):
            module.__class__ = nn.Linear
        if getattr(module, "cast_input_dtype_enabled", True) is False:
            module.cast_input_dtype_enabled = True


def _swap(module: nn.Module) -> bool:
    if type(module) is nn.Linear:
        module.__class__ = HalfComputeLinear
        return True
    return isinstance(module, HalfComputeLinear)


def lora_in_half_compute(lm: nn.Module) -> int:
    """Adapter products of ``lm``'s LoRA layers run in the activations' dtype on fp32 weights; returns how many
    layers were switched (0 without peft LoRA layers)."""
    switched = 0
    for module in lm.modules():
        lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
        if not isinstance(lora_a, nn.ModuleDict) or not hasattr(module, "cast_input_dtype_enabled"):
            continue
        pairs = [(lora_a[k], lora_b[k]) for k in lora_a if k in lora_b]
        if pairs and all(type(m) in (nn.Linear, HalfComputeLinear) for pair in pairs for m in pair):
            for a, b in pairs:
                _swap(a)
                _swap(b)
            module.cast_input_dtype_enabled = False  # x stays in the LM's dtype; the weights come to it
            if type(module) is _peft_lora_linear():
                module.__class__ = _one_node_class(type(module))  # peft's lora.Linear: one node when plain
            switched += 1
    return switched


def projector_in_half_compute(projector: nn.Module) -> bool:
    """A trainable half-precision projector made of ``nn.Linear`` layers and parameter-free modules gets fp32
    master weights and computes in its input's dtype; returns whether it was switched."""
    params = list(projector.parameters())
    if not params or not any(p.requires_grad for p in params) or params[0].dtype not in HALF:
        return False
    holders = [m for m in projector.modules() if any(True for _ in m.parameters(recurse=False))]
    if not all(type(m) in (nn.Linear, HalfComputeLinear) for m in holders):
        return False
    projector.float()
    for module in holders:
        _swap(module)
    return True
