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
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from stitch.kernels.graphs import static_block

HALF = (torch.bfloat16, torch.float16)


class HalfComputeLinear(nn.Linear):
    """``nn.Linear`` whose (fp32 master) weight and bias are cast to the input's dtype for the product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        bias = None if self.bias is None or self.bias.dtype == x.dtype else self.bias.to(x.dtype)
        return F.linear(x, weight, self.bias if bias is None else bias)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``scaling * (a @ b)`` as one GEMM (the scaling is the GEMM's alpha; with beta 0 the uninitialised first
    argument is never read): one kernel where a product and an in-place multiply are two."""
    return torch.addmm(a.new_empty(a.shape[0], b.shape[1]), a, b, beta=0, alpha=scaling)


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
        g_low = scaled_mm(g, b, ctx.scaling)
        grad_x = (g @ weight).addmm_(g_low, a).reshape(ctx.shape) if ctx.needs_input_grad[0] else None
        grad_a = (g_low.t() @ flat).to(ctx.dtypes[0]) if ctx.needs_input_grad[3] else None
        grad_b = scaled_mm(g.t(), low, ctx.scaling).to(ctx.dtypes[1]) if ctx.needs_input_grad[4] else None
        return grad_x, None, None, grad_a, grad_b, None


class _OneNodeLoRA:
    """Mixed into peft's ``lora.Linear``: plain LoRA through ``LoRAProduct``; anything else through peft."""

    def plain_adapter(self, args: tuple = (), kwargs: dict | None = None) -> str | None:
        """The active adapter's name when this call is plain LoRA (one adapter, no dropout while training, no
        variant, not merged, a frozen ``nn.Linear`` base), else None: peft's own forward must run."""
        name = self.active_adapters[0] if len(self.active_adapters) == 1 else None
        base = self.base_layer
        plain = (not args and not kwargs and name is not None and not self.disable_adapters and not self.merged
                 and name in self.lora_A and name not in getattr(self, "lora_variant", {})
                 and (not self.training or isinstance(self.lora_dropout[name], nn.Identity))
                 and type(base) is nn.Linear and not base.weight.requires_grad
                 and (base.bias is None or not base.bias.requires_grad))
        return name if plain else None

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        name = self.plain_adapter(args, kwargs)
        if name is None:
            return super().forward(x, *args, **kwargs)
        return static_block(self, x, self.lora_product)  # a shape-static GPU training step: one CUDA graph each way

    def lora_product(self, x: torch.Tensor) -> torch.Tensor:
        """The plain adapter's ``LoRAProduct`` (``plain_adapter`` said this call is plain)."""
        name, base = self.active_adapters[0], self.base_layer
        return LoRAProduct.apply(x, base.weight, base.bias, self.lora_A[name].weight, self.lora_B[name].weight,
                                 self.scaling[name])


# A base projection at most this wide (Qwen3.5's 32-wide in_proj_a / in_proj_b) joins the adapters' shared GEMM in
# SharedInputLoRA: alone, its product is a skinny GEMM that cuBLAS runs on a 32-wide tile.
NARROW = 256


class SharedInputLoRA(torch.autograd.Function):
    """Plain LoRA projections of one input as one autograd node (``shared_input_projections``).

    ``layout`` is one ``(scaling, narrow)`` per projection and ``tensors`` its ``(W, A, B)`` in that order. Forward,
    one GEMM of ``x`` with every ``A`` and every narrow ``W`` stacked gives all the rank-r products and the narrow
    base outputs; each wide ``W`` keeps its own GEMM; each ``B`` adds its scaled product. Backward, every
    ``g B s`` and narrow ``g`` sit side by side, so one GEMM gives ``x``'s gradient from all of them (plus one per
    wide ``W``) and one gives every ``A``'s gradient. Four projections of a Gated DeltaNet layer take 19 GEMMs
    instead of four ``LoRAProduct`` nodes' 32. The numbers are the same products in another grouping."""

    @staticmethod
    def forward(ctx, x, layout, *tensors):  # noqa: ANN001, ANN205 - autograd's signature
        weights, adapters_a, adapters_b = tensors[0::3], tensors[1::3], tensors[2::3]
        a = [t.to(x.dtype) for t in adapters_a]
        b = [t.to(x.dtype) for t in adapters_b]
        narrow = [w.to(x.dtype) for w, (_, is_narrow) in zip(weights, layout, strict=True) if is_narrow]
        stacked = torch.cat([*a, *narrow])
        flat = x.reshape(-1, x.shape[-1])
        low_all = flat @ stacked.t()
        ranks = [t.shape[0] for t in a]
        lows = list(low_all[:, :sum(ranks)].split(ranks, dim=1))
        narrow_out = iter(low_all[:, sum(ranks):].split([w.shape[0] for w in narrow], dim=1))
        outs = []
        for (scaling, is_narrow), w, low, up in zip(layout, weights, lows, b, strict=True):
            if is_narrow:
                out = torch.addmm(next(narrow_out), low, up.t(), alpha=scaling)
            else:
                out = (flat @ w.t()).addmm_(low, up.t(), alpha=scaling)
            outs.append(out.reshape(*x.shape[:-1], w.shape[0]))
        wide = [w for w, (_, is_narrow) in zip(weights, layout, strict=True) if not is_narrow]
        ctx.save_for_backward(flat, stacked, low_all, *b, *wide)
        ctx.layout, ctx.ranks, ctx.shape = layout, ranks, x.shape
        ctx.dtypes = [(ta.dtype, tb.dtype) for ta, tb in zip(adapters_a, adapters_b, strict=True)]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):  # noqa: ANN001, ANN205
        flat, stacked, low_all, *rest = ctx.saved_tensors
        n = len(ctx.layout)
        b, wide = rest[:n], iter(rest[n:])
        ranks = ctx.ranks
        lows = low_all[:, :sum(ranks)].split(ranks, dim=1)
        g = [t.reshape(-1, t.shape[-1]) for t in grads]
        g_lows = [scaled_mm(gi, up, scaling) for gi, up, (scaling, _) in zip(g, b, ctx.layout, strict=True)]
        g_narrow = [gi for gi, (_, is_narrow) in zip(g, ctx.layout, strict=True) if is_narrow]
        g_stacked = torch.cat([*g_lows, *g_narrow], dim=1)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = g_stacked @ stacked
            for gi, (_, is_narrow) in zip(g, ctx.layout, strict=True):
                if not is_narrow:
                    grad_x.addmm_(gi, next(wide))
            grad_x = grad_x.reshape(ctx.shape)
        wants_a = any(ctx.needs_input_grad[3 + 3 * i] for i in range(n))
        grad_a = (g_stacked[:, :sum(ranks)].t() @ flat).split(ranks, dim=0) if wants_a else None
        out: list = [grad_x, None]
        for i, (gi, low, (scaling, _)) in enumerate(zip(g, lows, ctx.layout, strict=True)):
            dtype_a, dtype_b = ctx.dtypes[i]
            want_a, want_b = ctx.needs_input_grad[3 + 3 * i], ctx.needs_input_grad[4 + 3 * i]
            out += [None, grad_a[i].to(dtype_a) if want_a else None,
                    scaled_mm(gi.t(), low, scaling).to(dtype_b) if want_b else None]
        return tuple(out)


def shared_input_projections(x: torch.Tensor, modules: Sequence[nn.Module]) -> list[torch.Tensor]:
    """``[m(x) for m in modules]`` for projections that read the same ``x`` (a Gated DeltaNet's in_proj_*, an
    attention's q/k/v): one ``SharedInputLoRA`` node when every module is a plain LoRA layer switched by
    ``lora_in_half_compute`` on a bias-free base, each module's own forward otherwise."""
    names = [m.plain_adapter() if isinstance(m, _OneNodeLoRA) else None for m in modules]
    if any(name is None for name in names) or any(m.base_layer.bias is not None for m in modules):
        return [m(x) for m in modules]
    layout, tensors = [], []
    for m, name in zip(modules, names, strict=True):
        weight = m.base_layer.weight
        layout.append((m.scaling[name], weight.shape[0] <= NARROW))
        tensors += [weight, m.lora_A[name].weight, m.lora_B[name].weight]
    return list(SharedInputLoRA.apply(x, tuple(layout), *tensors))


def _peft_lora_linear() -> type:
    from peft.tuners.lora.layer import Linear  # deferred: plugin loading skips transformers

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
