"""CUDA graphs for the shape-static blocks of a training step.

A packed SFT step on a 4B model is paced by the host: ~4,100 kernel launches and ~20,000 dispatched operators a
step for ~130-160 ms of device work (BENCHMARKS.md §0s). Packing makes a step's shapes static (every step is
``rows x token_budget`` tokens), so a block whose work depends only on its input's shape (an MLP: three LoRA
projections and an activation, ~16 launches forward and ~26 backward) can be captured once and replayed: one copy
and one graph launch forward, one copy, one graph launch and a copy per trainable parameter backward.

``static_block(module, x, forward)`` is what a model plugin's block calls: it runs ``forward(x)`` eagerly, or
replays the graph captured for ``module`` once the same input signature has been seen on ``REPEATS`` calls in a row.
The signature covers everything the captured kernels depend on: the input's shape, strides, dtype and device,
whether it needs a gradient, each parameter's storage address, dtype and ``requires_grad``, and the LoRA adapter
each LoRA layer runs. Anything else runs eagerly: CPU tensors, no-grad or eval calls, autocast, saved-tensor hooks
(activation checkpointing, offloading), module hooks, distributed runs (FSDP2 moves its parameters' storage),
LoRA layers that are not plain (dropout, several adapters, a disabled adapter), a signature other than the
captured one, and a second forward while the first one's backward is still pending (the graph holds one call's
activations: DPO's chosen and rejected passes before one backward).

Memory: each block's forward graph has a private pool (it holds the activations its backward reads, as eager
autograd does during a step); all backward graphs share one pool, which is safe in any replay order because a
backward graph's outputs are consumed before any other backward graph runs. ``STITCH_CUDA_GRAPHS=0`` turns the
whole mechanism off.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

log = logging.getLogger("stitch")

ENABLED = os.environ.get("STITCH_CUDA_GRAPHS", "1") != "0"
REPEATS = 2  # identical calls in a row before a block is captured (a padded step's shapes rarely repeat)
WARMUP = 2  # eager forward + backward passes on a side stream before capture (cuBLAS, Triton's first launches)

STATS = {"captured": 0, "replayed": 0, "failed": 0}  # process-wide counters (benchmarks report replays per step)


class _Token:
    """Lives as long as the autograd graph of one replayed forward: a pending backward."""

    __slots__ = ("__weakref__",)


class BlockGraph:
    """One block's forward and backward captured for one input signature."""

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                 params: list[nn.Parameter], signature: tuple) -> None:
        self.signature = signature
        self.params = params
        self.static_in = x.detach().clone().requires_grad_(x.requires_grad)
        wrt = ([self.static_in] if x.requires_grad else []) + params
        side = _side_stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                out = forward(self.static_in)
                torch.autograd.grad(out, wrt, torch.ones_like(out), allow_unused=True)
            del out
        torch.cuda.current_stream().wait_stream(side)
        self.forward_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.forward_graph):
            self.static_out = forward(self.static_in)
        self.static_grad_out = torch.empty_like(self.static_out)
        self.backward_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.backward_graph, pool=_backward_pool()):
            # retain_graph: the forward graph's saved activations stay allocated in its pool, so no later capture
            # can place its own tensors where this block's replayed forward writes them
            grads = torch.autograd.grad(self.static_out, wrt, self.static_grad_out, retain_graph=True,
                                        allow_unused=True)
        self.grad_in = grads[0] if x.requires_grad else None
        self.param_grads = tuple(grads[1:] if x.requires_grad else grads)
        self._pending: weakref.ref | None = None

    def pending(self) -> bool:
        """Whether a replayed forward's backward has not run yet while its autograd graph is still alive."""
        return self._pending is not None and self._pending() is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _Replay.apply(self, x, *self.params)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graph, x, *params):  # noqa: ANN001, ANN205 - autograd's signature
        graph.static_in.detach().copy_(x)
        graph.forward_graph.replay()
        ctx.graph, ctx.token = graph, _Token()
        graph._pending = weakref.ref(ctx.token)
        STATS["replayed"] += 1
        return graph.static_out.detach()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        graph = ctx.graph
        graph.static_grad_out.copy_(grad)
        graph.backward_graph.replay()
        graph._pending = None
        return (None, graph.grad_in, *graph.param_grads)


class _BlockState:
    __slots__ = ("graph", "last", "seen", "failed")

    def __init__(self) -> None:
        self.graph: BlockGraph | None = None
        self.last: tuple | None = None
        self.seen = 0
        self.failed = False


_STATES: weakref.WeakKeyDictionary[nn.Module, _BlockState] = weakref.WeakKeyDictionary()
_SIDE: list[torch.cuda.Stream] = []
_POOL: list[Any] = []


def _side_stream() -> torch.cuda.Stream:
    if not _SIDE:
        _SIDE.append(torch.cuda.Stream())
    return _SIDE[0]


def _backward_pool() -> Any:
    if not _POOL:
        _POOL.append(torch.cuda.graph_pool_handle())
    return _POOL[0]


def _hooked(module: nn.Module) -> bool:
    from torch.nn.modules import module as base

    if base._global_forward_hooks or base._global_forward_pre_hooks or base._global_backward_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
               for m in module.modules())


def _adapters(module: nn.Module) -> tuple | None:
    """Each LoRA layer's active plain adapter, or None when one is not plain (peft's own forward must run: dropout,
    several adapters, a disabled adapter) or is a peft layer stitch did not switch to its one-node product."""
    from stitch.model.precision import _OneNodeLoRA

    names = []
    for m in module.modules():
        if isinstance(m, _OneNodeLoRA):
            name = m.plain_adapter()
            if name is None:
                return None
            names.append(name)
        elif hasattr(m, "lora_A") and hasattr(m, "active_adapters"):
            return None
    return tuple(names)


def eligible(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether this call may run a captured graph at all (before its signature is looked at)."""
    return (ENABLED and x.is_cuda and module.training and torch.is_grad_enabled()
            and not torch.is_autocast_enabled(x.device.type) and not torch.cuda.is_current_stream_capturing()
            and not torch.compiler.is_compiling()
            and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
            and not (torch.distributed.is_available() and torch.distributed.is_initialized()))


def signature(module: nn.Module, x: torch.Tensor) -> tuple | None:
    """What a captured graph of ``module`` on ``x`` depends on; None when it cannot be captured (module hooks, a
    LoRA layer that is not plain, a parameter that is not a plain dense tensor)."""
    if _hooked(module):
        return None
    adapters = _adapters(module)
    if adapters is None:
        return None
    params = []
    for p in module.parameters():
        if type(p) is not nn.Parameter or p.layout != torch.strided:
            return None
        params.append((p.data_ptr(), p.dtype, p.requires_grad))
    return (tuple(x.shape), x.stride(), x.dtype, x.device, x.requires_grad, tuple(params), adapters)


def static_block(module: nn.Module, x: torch.Tensor, forward: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``forward(x)``, through ``module``'s captured CUDA graph when the call allows one (module docstring)."""
    if not eligible(module, x):
        return forward(x)
    state = _STATES.get(module)
    if state is None:
        state = _STATES[module] = _BlockState()
    if state.failed:
        return forward(x)
    sig = signature(module, x)
    if sig is None:
        return forward(x)
    graph = state.graph
    if graph is not None:
        if graph.signature != sig or graph.pending():
            return forward(x)
        return graph(x)
    state.seen = state.seen + 1 if sig == state.last else 1
    state.last = sig
    if state.seen < REPEATS:
        return forward(x)
    try:
        state.graph = BlockGraph(forward, x, [p for p in module.parameters() if p.requires_grad], sig)
    except Exception as err:  # a kernel that cannot be captured: this block stays eager, the run goes on
        state.failed = True
        STATS["failed"] += 1
        log.warning("%s: CUDA graph capture failed, running it eagerly: %s", type(module).__name__, err)
        return forward(x)
    STATS["captured"] += 1
    return state.graph(x)


def drop_graphs(model: nn.Module) -> int:
    """Forget every captured graph of ``model``'s blocks (their memory goes back when nothing else holds it);
    returns how many were dropped."""
    dropped = 0
    for m in model.modules():
        state = _STATES.pop(m, None)
        dropped += state is not None and state.graph is not None
    return dropped
