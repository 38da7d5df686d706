"""Torch's CPU float math settled before it runs on several threads.

On x86, torch sends contiguous float unary ops (cos, sin, exp, log, sqrt, tanh, erf, ...) to MKL's vector math
library, each intra-op thread calling it on its own chunk. MKL picks each function's kernel on that function's
first call in the process. With the oneMKL that torch's wheels bundle (2024.2), a first call made by several
threads at once can run one thread's chunk on a low-accuracy kernel: ``cos(1.0)`` comes out 0.5403335 instead of
0.5403023. Every later call is right, so the damage is one step of one process: a resumed run's first forward
(its rotary embedding's ``cos``) drifts from the uninterrupted run's. This is pytorch/pytorch#188792.

``settle_cpu_math`` makes each of those first calls on a tensor too small to split across threads, so each
kernel choice is made by one thread before any parallel call. The CLI, ``run_stage`` and the rollout workers call
it on start; it costs about two milliseconds and changes no result of a settled process."""

from __future__ import annotations

import functools

import torch

# The float unary ops ATen hands to MKL's vector math library (aten/src/ATen/cpu/vml.h), by torch name.
VML_OPS = ("acos", "asin", "atan", "cos", "cosh", "erf", "erfc", "erfinv", "exp", "expm1", "log", "log10", "log1p",
           "log2", "sin", "sinh", "sqrt", "tan", "tanh", "trunc", "lgamma")


@functools.cache
def settle_cpu_math() -> tuple[str, ...]:
    """Call every op of ``VML_OPS`` once in float32 and float64 on this thread, on 16 elements (under ATen's
    smallest parallel grain, so no worker thread joins). Returns the ops called; only the first call works."""
    for dtype in (torch.float32, torch.float64):
        x = torch.linspace(0.1, 0.9, 16, dtype=dtype)
        for name in VML_OPS:
            getattr(torch, name)(x)
    return VML_OPS
