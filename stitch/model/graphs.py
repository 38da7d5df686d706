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
from collections.abc import Callable, Sequence
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

    def __init__(self, forward: Callable[[torch.Tensor], Any], x: torch.Tensor, params: list[nn.Parameter],
                 signature: tuple) -> None:
        self.signature = signature
        self.params = params
        self.static_in = x.detach().clone().requires_grad_(x.requires_grad)
        wrt = ([self.static_in] if x.requires_grad else []) + params
        side = _side_stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                outs = _as_tuple(forward(self.static_in))
                torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs], allow_unused=True)
            del outs
        torch.cuda.current_stream().wait_stream(side)
        self.forward_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.forward_graph):
            out = forward(self.static_in)
        self.tuple_out = isinstance(out, tuple)
        self.static_outs = _as_tuple(out)
        self.static_grad_outs = tuple(torch.empty_like(o) for o in self.static_outs)
        self.backward_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.backward_graph, pool=_backward_pool()):
            # retain_graph: the forward graph's saved activations stay allocated in its pool, so no later capture
            # can place its own tensors where this block's replayed forward writes them
            grads = torch.autograd.grad(self.static_outs, wrt, self.static_grad_outs, retain_graph=True,
                                        allow_unused=True)
        self.grad_in = grads[0] if x.requires_grad else None
        self.param_grads = tuple(grads[1:] if x.requires_grad else grads)
        self._pending: weakref.ref | None = None

    def pending(self) -> bool:
        """Whether a replayed forward's backward has not run yet while its autograd graph is still alive."""
        return self._pending is not None and self._pending() is not None

    def __call__(self, x: torch.Tensor) -> Any:
        outs = _Replay.apply(self, x, *self.params)
        return outs if self.tuple_out else outs[0]


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graph, x, *params):  # noqa: ANN001, ANN205 - autograd's signature
        graph.static_in.detach().copy_(x)
        graph.forward_graph.replay()
        ctx.graph, ctx.token = graph, _Token()
        graph._pending = weakref.ref(ctx.token)
        STATS["replayed"] += 1
        return tuple(o.detach() for o in graph.static_outs)

    @staticmethod
    def backward(ctx, *grads):  # noqa: ANN001, ANN205
        graph = ctx.graph
        for buffer, grad in zip(graph.static_grad_outs, grads, strict=True):
            buffer.copy_(grad) if grad is not None else buffer.zero_()
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


def _parameters(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    return [p for m in modules for p in m.parameters()]


def signature(modules: nn.Module | Sequence[nn.Module], x: torch.Tensor) -> tuple | None:
    """What a captured graph of a forward over ``modules`` on ``x`` depends on; None when it cannot be captured
    (module hooks, a LoRA layer that is not plain, a parameter that is not a plain dense tensor)."""
    modules = (modules,) if isinstance(modules, nn.Module) else tuple(modules)
    adapters = []
    for module in modules:
        found = None if _hooked(module) else _adapters(module)
        if found is None:
            return None
        adapters += found
    params = []
    for p in _parameters(modules):
        if type(p) is not nn.Parameter or p.layout != torch.strided:
            return None
        params.append((p.data_ptr(), p.dtype, p.requires_grad))
    return (tuple(x.shape), x.stride(), x.dtype, x.device, x.requires_grad, tuple(params), tuple(adapters))


def static_block(module: nn.Module, x: torch.Tensor, forward: Callable[[torch.Tensor], Any],
                 modules: Sequence[nn.Module] | None = None) -> Any:
    """``forward(x)`` (a tensor or a tuple of tensors), through a CUDA graph captured for ``module`` when the call
    allows one (module docstring). ``modules`` are those whose parameters ``forward`` reads (default: ``module``);
    ``module`` keys the graph, one per module."""
    if not eligible(module, x):
        return forward(x)
    state = _STATES.get(module)
    if state is None:
        state = _STATES[module] = _BlockState()
    if state.failed:
        return forward(x)
    modules = (module,) if modules is None else tuple(modules)
    sig = signature(modules, x)
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
        state.graph = BlockGraph(forward, x, [p for p in _parameters(modules) if p.requires_grad], sig)
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
