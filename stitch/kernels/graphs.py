"""CUDA graphs for the shape-static blocks of a training step.

A packed SFT step on a 4B model is paced by the host: ~4,100 kernel launches and ~20,000 dispatched operators a
step for ~130-160 ms of device work. Packing makes a step's shapes static (every step is
``rows x token_budget`` tokens), so a block whose work depends only on its input's shape (a plain LoRA layer: two
casts and three GEMMs forward, seven launches backward; an MLP; a Gated DeltaNet's four input projections) can be
captured once and replayed: one copy and one graph launch forward, one copy, one graph launch and a copy per
trainable parameter backward. A block called inside another (the LoRA layers of a graphed MLP) is part of the
outer one's graph.

``static_block(module, x, forward)`` is what a model plugin's block calls (``x`` a tensor or a tuple of them; the
output too): it runs ``forward(x)`` eagerly, or replays the graph captured for ``module`` once the same input
signature has been seen on ``REPEATS`` calls in a row.
The signature covers everything the captured kernels depend on: the input's shape, strides, dtype and device,
whether it needs a gradient, each parameter's storage address, dtype and ``requires_grad``, and the LoRA adapter
each LoRA layer runs. Anything else runs eagerly: CPU tensors, no-grad or eval calls, autocast, saved-tensor hooks
(activation checkpointing, offloading), module hooks, distributed runs (FSDP2 moves its parameters' storage),
LoRA layers that are not plain (dropout, several adapters, a disabled adapter), a signature other than the
captured one, and a second forward while the first one's backward is still pending (the graph holds one call's
activations: DPO's chosen and rejected passes before one backward).

Memory: each block's forward graph has a private pool (it holds the activations its backward reads, as eager
autograd does during a step). The backward graphs hold nothing between steps: they share one pool, read the gradient
they receive from one buffer per output shape that every block shares, and their outputs (the gradients for the
block's inputs and parameters) are copied out as soon as the graph has replayed, so the pool holds no tensor after a
capture and every backward graph reuses the same memory. That is safe in any order of capture and replay: a
backward graph's gradient-in buffer is filled just before it replays, and its outputs are read just after, before
anything else runs on the device. ``STITCH_CUDA_GRAPHS=0`` turns the whole mechanism off; ``keep_eager(model)``
turns it off for one model (a model plugin's ``ModelSpec.cuda_graphs=False``: Nemotron-H, whose packed 4B step is
~5 % slower with its blocks graphed).
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as base

log = logging.getLogger("stitch")

ENABLED = os.environ.get("STITCH_CUDA_GRAPHS", "1") != "0"
REPEATS = 2  # identical calls in a row before a block is captured (a padded step's shapes rarely repeat)
CAPTURES = 3  # captures a block may make in a process (a new signature that repeats replaces the old graph)
ROOM_FACTOR, ROOM_MARGIN = 8, 1 << 30  # free memory a capture asks for: 8x its inputs' bytes + 1 GiB (room_for)
WARMUP = 2  # eager forward + backward passes on a side stream before capture (cuBLAS, Triton's first launches)


class _Token:
    """Lives as long as the autograd graph of one replayed forward: a pending backward."""

    __slots__ = ("__weakref__",)


class BlockGraph:
    """One block's forward and backward captured for one input signature."""

    def __init__(self, forward: Callable[..., Any], xs: tuple[torch.Tensor, ...], layout: Layout,
                 signature: tuple) -> None:
        self.signature = signature
        self.params = [p for p in layout.params if p.requires_grad]
        self.static_ins = tuple(x.detach().clone().requires_grad_(x.requires_grad) for x in xs)
        with _stand_ins(layout, self.params) as leaves:
            self._capture(forward, [x for x in self.static_ins if x.requires_grad] + leaves)
        self._pending: weakref.ref | None = None

    def _capture(self, forward: Callable[..., Any], wrt: list[torch.Tensor]) -> None:
        side = _side_stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                outs = _as_tuple(forward(*self.static_ins))
                torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs], allow_unused=True)
            del outs
        torch.cuda.current_stream().wait_stream(side)
        self.forward_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.forward_graph):
            out = forward(*self.static_ins)
        self.tuple_out = isinstance(out, tuple)
        self.static_outs = _as_tuple(out)
        self.static_grad_outs = tuple(_grad_buffer(i, o) for i, o in enumerate(self.static_outs))
        self.backward_graph = torch.cuda.CUDAGraph()
        pool = _backward_pool()
        _LIVE.add(self)
        with torch.cuda.graph(self.backward_graph, pool=pool):
            # retain_graph: the forward graph's saved activations stay allocated in its pool, so no later capture
            # can place its own tensors where this block's replayed forward writes them
            grads = torch.autograd.grad(self.static_outs, wrt, self.static_grad_outs, retain_graph=True,
                                        allow_unused=True)
        # addresses only: the pool takes the outputs' memory back, for the next capture to reuse; a replay's outputs
        # are copied out of it at once (_Replay.backward)
        grads = iter([None if g is None else _unowned(g) for g in grads])
        self.input_grads = tuple(next(grads) if x.requires_grad else None for x in self.static_ins)
        self.param_grads = tuple(grads)

    def pending(self) -> bool:
        """Whether a replayed forward's backward has not run yet while its autograd graph is still alive."""
        return self._pending is not None and self._pending() is not None

    def __call__(self, *xs: torch.Tensor) -> Any:
        outs = _Replay.apply(self, *xs, *self.params)
        return outs if self.tuple_out else outs[0]


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graph, *tensors):  # noqa: ANN001, ANN205 - autograd's signature
        for buffer, x in zip(graph.static_ins, tensors, strict=False):  # the inputs, then the parameters
            buffer.detach().copy_(x)
        graph.forward_graph.replay()
        ctx.graph, ctx.token = graph, _Token()
        graph._pending = weakref.ref(ctx.token)
        return tuple(o.detach() for o in graph.static_outs)

    @staticmethod
    def backward(ctx, *grads):  # noqa: ANN001, ANN205
        graph = ctx.graph
        for buffer, grad in zip(graph.static_grad_outs, grads, strict=True):
            buffer.copy_(grad) if grad is not None else buffer.zero_()
        graph.backward_graph.replay()
        graph._pending = None
        return (None, *(None if g is None else g.clone() for g in (*graph.input_grads, *graph.param_grads)))


class _BlockState:
    __slots__ = ("graph", "last", "seen", "layout", "captures")

    def __init__(self) -> None:
        self.graph: BlockGraph | None = None
        self.last: tuple | None = None
        self.seen = 0
        self.layout: Layout | None = None
        self.captures = 0


_STATES: weakref.WeakKeyDictionary[nn.Module, _BlockState] = weakref.WeakKeyDictionary()
_EAGER: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # keep_eager's modules
_DEPTH = [0]  # static_block calls under way on this (the training) thread
_SIDE: list[torch.cuda.Stream] = []
_POOL: list[Any] = []


def room_for(xs: tuple[torch.Tensor, ...]) -> bool:
    """Whether the device has room for one more block's graph. A graph keeps buffers eager autograd frees or never
    makes: a copy of its input, its output, the gradient it receives and the one it returns (on a dense 4B packed
    step, 180 blocks took 11.7 GiB more at peak than eager). Capture only with ``ROOM_FACTOR`` times the inputs'
    bytes free (what the driver has plus what torch holds unused), so a run that fits eagerly does not run out
    of memory for its graphs; short of that the block stays eager."""
    device = xs[0].device
    free, _ = torch.cuda.mem_get_info(device)
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    need = ROOM_FACTOR * sum(x.numel() * x.element_size() for x in xs) + ROOM_MARGIN
    return free + unused >= need


@contextlib.contextmanager
def _stand_ins(layout: Layout, params: list[nn.Parameter]) -> Iterator[list[nn.Parameter]]:
    """Fresh leaf parameters on the same storage in place of ``params`` while a block is captured. autograd keeps one
    gradient accumulator per parameter and runs it on the stream it was made on; a graph of an earlier step still
    alive (a loss kept for logging) keeps it on the default stream, and a backward captured on the capture stream
    would then wait on the default stream, which invalidates the capture."""
    leaves = [nn.Parameter(p.detach(), requires_grad=True) for p in params]
    owners = [layout.owners[id(p)] for p in params]
    for (module, name), leaf in zip(owners, leaves, strict=True):
        module._parameters[name] = leaf
    try:
        yield leaves
    finally:
        for (module, name), p in zip(owners, params, strict=True):
            module._parameters[name] = p


def _side_stream() -> torch.cuda.Stream:
    if not _SIDE:
        _SIDE.append(torch.cuda.Stream())
    return _SIDE[0]


_LIVE: weakref.WeakSet[BlockGraph] = weakref.WeakSet()  # the graphs whose backward uses the shared pool
_GRAD_BUFFERS: dict[tuple, torch.Tensor] = {}


def _backward_pool() -> Any:
    """The shared backward pool; a new one once every graph that used the last one is gone (torch frees a pool with
    its last graph, and a capture into a freed pool's handle fails)."""
    if not _POOL or not _LIVE:
        _POOL[:] = [torch.cuda.graph_pool_handle()]
    return _POOL[0]


def _grad_buffer(index: int, out: torch.Tensor) -> torch.Tensor:
    """The buffer a backward graph reads the gradient of its ``index``-th output from: one per index, shape, strides
    and dtype, shared by every block (each backward fills it just before its replay)."""
    key = (index, tuple(out.shape), out.stride(), out.dtype, out.device)
    if key not in _GRAD_BUFFERS:
        _GRAD_BUFFERS[key] = torch.empty_like(out)
    return _GRAD_BUFFERS[key]


def _unowned(t: torch.Tensor) -> torch.Tensor:
    """A tensor on ``t``'s memory that does not keep it allocated (as torch's own CUDA graph trees read the outputs
    of graphs in a shared pool): what a replay writes there is read right after it."""
    storage = torch._C._construct_storage_from_data_pointer(t.untyped_storage().data_ptr(), t.device,
                                                           t.untyped_storage().nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.shape, t.stride())


class Layout:
    """What a block's forward reads, collected once per block: its parameters, its LoRA layers (whose active adapter
    is read on every call) and the modules whose hooks a graph would skip (the block's modules, the LoRA layers and
    their base layers); None fields when it cannot be captured (peft layers stitch did not switch to its one-node
    product, parameters that are not plain dense tensors)."""

    __slots__ = ("params", "owners", "loras", "watched", "capturable")

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.params = [p for m in modules for p in m.parameters()]
        # (module, name) of every trainable parameter, to stand fresh leaves in for them while capturing
        entries = [(s, n, p) for m in modules for s in m.modules() for n, p in s.named_parameters(recurse=False)
                   if p.requires_grad]
        self.owners = {id(p): (s, n) for s, n, p in entries}
        # stitch.kernels.precision's one-node LoRA layers, known by their plain_adapter()
        self.loras = [s for m in modules for s in m.modules() if callable(getattr(s, "plain_adapter", None))]
        self.watched = [*modules, *self.loras, *(lora.base_layer for lora in self.loras)]
        unswitched = any(hasattr(s, "lora_A") and hasattr(s, "active_adapters") and s not in self.loras
                         for m in modules for s in m.modules())
        dense = all(type(p) is nn.Parameter and p.layout == torch.strided for p in self.params)
        self.capturable = dense and not unswitched and len(self.owners) == len(entries)  # no tied trainable one

    def signature(self, xs: tuple[torch.Tensor, ...]) -> tuple | None:
        """What a captured graph on inputs ``xs`` depends on; None when this call cannot use one (module hooks, a
        LoRA layer whose active adapter is not plain, nothing that needs a gradient)."""
        if not self.capturable or base._global_forward_hooks or base._global_forward_pre_hooks \
                or base._global_backward_hooks:
            return None
        if any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
               for m in self.watched):
            return None
        adapters = tuple(lora.plain_adapter() for lora in self.loras)
        if None in adapters:
            return None
        params = tuple((p.data_ptr(), p.dtype, p.requires_grad) for p in self.params)
        inputs = tuple((tuple(x.shape), x.stride(), x.dtype, x.device, x.requires_grad) for x in xs)
        if not any(grad for *_, grad in inputs) and not any(grad for *_, grad in params):
            return None  # a forward-only call: nothing for a backward graph to do
        return inputs, params, adapters


def eligible(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether this call may run a captured graph at all (before its signature is looked at)."""
    return (ENABLED and x.is_cuda and module.training and torch.is_grad_enabled()
            and not torch.is_autocast_enabled(x.device.type) and not torch.cuda.is_current_stream_capturing()
            and not torch.compiler.is_compiling()
            and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
            and not (torch.distributed.is_available() and torch.distributed.is_initialized()))


def static_block(module: nn.Module, x: torch.Tensor | tuple[torch.Tensor, ...], forward: Callable[..., Any],
                 modules: Sequence[nn.Module] | None = None) -> Any:
    """``forward(x)``, or ``forward(*x)`` for a tuple of tensors, returning a tensor or a tuple of tensors, through a
    CUDA graph captured for ``module`` when the call allows one (module docstring). ``modules`` are those whose
    parameters ``forward`` reads (default: ``module``); ``module`` keys the graph. A block whose signature changes
    (its parameters moved, another shape) is captured again once the new signature repeats, at most ``CAPTURES``
    times. A replayed output lives in the graph's buffer until the block's next replay, and autograd's version
    checks do not see inside the graph: the caller reads it, never modifies it in place."""
    xs = x if isinstance(x, tuple) else (x,)
    if _DEPTH[0] or module in _EAGER or not eligible(module, xs[0]):
        return forward(*xs)
    _DEPTH[0] += 1  # a block inside this one (a LoRA layer in an MLP) runs as part of this one's graph or forward
    try:
        return _static_block(module, xs, forward, modules)
    finally:
        _DEPTH[0] -= 1


def _static_block(module: nn.Module, xs: tuple[torch.Tensor, ...], forward: Callable[..., Any],
                  modules: Sequence[nn.Module] | None) -> Any:
    state = _STATES.get(module)
    if state is None:
        state = _STATES[module] = _BlockState()
    modules = (module,) if modules is None else tuple(modules)
    if state.layout is None:
        state.layout = Layout(modules)
    sig = state.layout.signature(xs)
    if sig is None:
        return forward(*xs)
    graph = state.graph
    if graph is not None and graph.signature == sig:
        return forward(*xs) if graph.pending() else graph(*xs)
    state.seen = state.seen + 1 if sig == state.last else 1
    state.last = sig
    if state.seen < REPEATS or state.captures >= CAPTURES or (graph is not None and graph.pending()):
        return forward(*xs)
    state.layout = Layout(modules)  # afresh: an adapter may have been added since the layout was read
    sig = state.layout.signature(xs)
    if sig is None:
        return forward(*xs)
    state.graph = None  # the previous graph's memory goes back before the new capture
    if not room_for(xs):
        state.seen = 0  # eager until the same signature repeats again with room
        return forward(*xs)
    try:
        state.graph = BlockGraph(forward, xs, state.layout, sig)
    except Exception as err:  # the run goes on eagerly; a failed capture can leave the allocator recording into its
        # pool, so no block of this process tries again
        global ENABLED
        ENABLED = False
        log.warning("%s: CUDA graph capture failed; every block of this process runs eagerly from now on: %s",
                    type(module).__name__, err)
        return forward(*xs)
    state.captures += 1
    return state.graph(*xs)


def keep_eager(model: nn.Module) -> None:
    """Every block of ``model`` (as it is now: call it after its LoRA layers exist) runs its eager forward, never a
    graph; for a model whose step the graphs' copies cost more than the launches they save."""
    drop_graphs(model)
    _EAGER.update(model.modules())


def drop_graphs(model: nn.Module) -> int:
    """Forget every captured graph of ``model``'s blocks (their memory goes back when nothing else holds it);
    returns how many were dropped."""
    dropped = 0
    for m in model.modules():
        state = _STATES.pop(m, None)
        dropped += state is not None and state.graph is not None
    if not _LIVE:
        _GRAD_BUFFERS.clear()
    return dropped
