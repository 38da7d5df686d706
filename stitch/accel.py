"""Kernels for model and encoder plugins: the fast paths of ``stitch.kernels`` that a plugin's layers call (see
docs/plugin-api.md, "stitch.accel"). Besides ``stitch.api``, the one stitch module a plugin may import.

Each has a reference path it must equal; the names here are stable, their homes in ``stitch.kernels`` may move.
"""

from __future__ import annotations

from stitch.kernels.graphs import drop_graphs, static_block
from stitch.kernels.precision import shared_input_projections
from stitch.kernels.shared_slots import SlotBytes
from stitch.kernels.varlen import (
    decode_cache_kwargs,
    fla_conv,
    fla_kernels_importable,
    fla_kernels_usable,
    fla_seqlens,
    fla_triton_problem,
    flatten_packed_rows,
    reference_conv,
    segments,
    varlen_kernels_ready,
    warn_kernel_fallback,
)

__all__ = [
    # packed training of hybrid layers: sample starts on one flattened row
    "flatten_packed_rows",
    "segments",
    "reference_conv",
    "fla_conv",
    "fla_seqlens",
    "fla_kernels_importable",
    "fla_kernels_usable",
    "fla_triton_problem",
    "varlen_kernels_ready",
    # a recurrent layer's call that carries a decode cache goes to transformers' forward
    "decode_cache_kwargs",
    # one warning per process when a GPU runs reference code for want of a plugin's kernels extra
    "warn_kernel_fallback",
    # several LoRA projections of one input as one autograd node (a model plugin's fused layer)
    "shared_input_projections",
    # shape-static training blocks replayed as CUDA graphs
    "static_block",
    "drop_graphs",
    # an encoder's prepare workers: where a payload sits in a shared slot
    "SlotBytes",
]
