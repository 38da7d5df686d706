"""Half-precision compute with fp32 master weights for the trainable parts (LoRA adapter, projector).

With a bf16/fp16 LM, peft keeps LoRA weights in fp32 and casts every activation to fp32 for the adapter's products.
Here the weights stay fp32 parameters (what the optimizer steps and keeps its state for, what adapters save), and
each product casts the small weight to the activation's dtype instead, so the GEMMs and activations stay in half
precision and gradients reach the fp32 weights through the cast (the usual mixed-precision recipe).
"""

from __future__ import annotations

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
