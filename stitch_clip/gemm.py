"""CLIP's MLP input projection, bias and quick-GELU as one GEMM on a Hopper GPU (quack's CuTe-DSL kernels).

Why: per 2,048 images the compiled tower ran fc1 as a cuBLAS GEMM and then inductor's bias + quick-GELU kernel, which
reads and writes the [102,400 x 3,072] activations through HBM once more in each of the 11 layers (~3.2 ms of a
~36 ms encode, BENCHMARKS.md §0k). Triton GEMMs with that epilogue lost to cuBLAS (§0m). quack's Hopper GEMM
(persistent, warp-specialised ping-pong, TMA) takes its epilogue as a Python function: with bias + quick-GELU in it,
fc1 took 0.739 ms on the H200 against 1.039 for the shipped pair and 0.772 for cuBLAS's GEMM alone
(benchmarks/quack_gemm.py, §0w). The GELU is computed in fp32 on the fp32 accumulator and rounded once.

Used where it can run: a CUDA device of compute capability 9.x (Hopper), half precision, ``quack-kernels``
installed (``pip install 'stitch-clip[hopper]'``). Anywhere else the MLP is transformers' own, unchanged. The tile
configuration is fixed, so an image's features are the same bits whatever it is batched with.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import warnings
from typing import Any

import torch


def _installed(distribution: str, module: str) -> bool:
    try:  # the distribution, not just a module of that name: PyPI's unrelated `quack` also imports as `quack`
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return importlib.util.find_spec(module) is not None


# looked up once at import: a compiled tower traces the MLP's check, and dynamo warns about cached functions
QUACK = _installed("quack-kernels", "quack")
HALF = (torch.float16, torch.bfloat16)
# quack's SM90 tile, measured best of six at ViT-B/32's fc1 (benchmarks/quack_gemm.py): 128 x 192 output tiles, two
# consumer warpgroups in ping-pong, clusters of two along M; fixed (not autotuned) so every run launches the same kernel
CONFIG = {"tile_m": 128, "tile_n": 192, "pingpong": True, "cluster_m": 2, "cluster_n": 1}
_BUILT: dict[str, Any] = {}
_FUSED_CLASSES: dict[type, type] = {}  # a CLIP MLP class -> its fused subclass (one per class, not per module)


def hopper(device: torch.device | str) -> bool:
    """Whether ``device`` is a CUDA device of compute capability 9.x and quack is installed: where the fused GEMM runs."""
    device = torch.device(device)
    return QUACK and device.type == "cuda" and torch.cuda.is_available() and \
        torch.cuda.get_device_capability(device)[0] == 9


def _kernel() -> tuple[Any, Any]:
    """quack's epilogue GEMM for ``quick_gelu(x @ w.T + b)`` and its pinned config, built at the first call."""
    if not _BUILT:
        from quack.activation import quick_gelu
        from quack.epilogue.frontend import gemm_epilogue
        from quack.epilogue.ops import RowVecLoad
        from quack.gemm_config import GemmConfig

        # the bias pinned as a row vector: quack infers it from the shapes, which is ambiguous where rows == width
        @gemm_epilogue(ops={"bias": RowVecLoad("bias")})
        def bias_quick_gelu(acc, bias):
            return {"D": quick_gelu(acc + bias)}

        _BUILT["mod"] = bias_quick_gelu
        _BUILT["config"] = GemmConfig(**CONFIG, is_dynamic_persistent=False, device_capacity=9)
    return _BUILT["mod"], _BUILT["config"]


@torch.library.custom_op("stitch_clip::linear_quick_gelu", mutates_args=())
def linear_quick_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``quick_gelu(x @ weight.T + bias)`` (CLIP's ``x * sigmoid(1.702 x)``) as one GEMM: x [..., K], weight [N, K],
    bias [N], all CUDA tensors of one half-precision dtype, K and N multiples of 8."""
    mod, config = _kernel()
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out = mod(flat, weight.t(), bias=bias.view(1, -1), config=config, tuned=False)["D"]
    return out.view(*x.shape[:-1], weight.shape[0])


@linear_quick_gelu.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class FusedQuickGeluMLP(torch.nn.Module):
    """A CLIP MLP (``fc1``, quick-GELU, ``fc2``) whose fc1 + bias + GELU run as ``linear_quick_gelu`` on CUDA half
    inputs; any other input goes through the class it was switched from (``fuse_quick_gelu``)."""

    fc1: torch.nn.Linear
    fc2: torch.nn.Linear

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if (hidden_states.is_cuda and hidden_states.dtype in HALF and hidden_states.dtype == self.fc1.weight.dtype
                and hidden_states.numel()):
            return self.fc2(torch.ops.stitch_clip.linear_quick_gelu(hidden_states, self.fc1.weight, self.fc1.bias))
        return super().forward(hidden_states)


def fuse_quick_gelu(model: Any) -> int:
    """Switch every CLIP MLP of ``model`` whose activation is quick-GELU (and whose widths TMA can tile: multiples of
    8) to ``FusedQuickGeluMLP`` in place (same weights and state-dict keys); the number switched."""
    switched = 0
    for module in _mlps(model):
        cls = type(module)
        if cls not in _FUSED_CLASSES:
            _FUSED_CLASSES[cls] = type(f"Fused{cls.__name__}", (FusedQuickGeluMLP, cls), {})
        module.__class__ = _FUSED_CLASSES[cls]
        switched += 1
    return switched


def _mlps(model: Any) -> list[Any]:
    """The CLIP MLPs of ``model`` that ``linear_quick_gelu`` can run: quick-GELU, a bias, widths TMA can tile
    (multiples of 8)."""
    out = []
    for module in model.modules():
        fc1 = getattr(module, "fc1", None)
        act = getattr(getattr(module, "config", None), "hidden_act", None)
        if (type(module).__name__ == "CLIPMLP" and act == "quick_gelu" and fc1 is not None and fc1.bias is not None
                and not fc1.in_features % 8 and not fc1.out_features % 8):
            out.append(module)
    return out


def check(fc1: torch.nn.Linear) -> None:
    """Run ``linear_quick_gelu`` once on 256 random rows with ``fc1``'s weight and bias (the kernel the tower will use,
    compiled now) and compare it with torch's fp32 arithmetic; raises where it fails or disagrees."""
    g = torch.Generator(device=fc1.weight.device).manual_seed(0)
    x = torch.randn(256, fc1.in_features, generator=g, device=fc1.weight.device).to(fc1.weight.dtype)
    got = linear_quick_gelu(x, fc1.weight, fc1.bias).float()
    y = torch.nn.functional.linear(x.float(), fc1.weight.float(), fc1.bias.float())
    want = y * torch.sigmoid(1.702 * y)
    if not torch.allclose(got, want, atol=5e-2, rtol=5e-2):
        raise RuntimeError(f"its output differs from torch's by up to {(got - want).abs().max().item():.3g}")


def fuse_where_it_runs(model: Any, device: torch.device | str, dtype: torch.dtype) -> int:
    """``fuse_quick_gelu`` where the fused GEMM runs (half precision on a Hopper GPU with quack installed) and a
    ``check`` of it passed; elsewhere, or with a warning where the check failed (a DSL build this driver cannot run,
    say), nothing is switched. The number of MLPs switched."""
    mlps = _mlps(model)
    if dtype not in HALF or not mlps or not hopper(device):
        return 0
    try:
        check(mlps[0].fc1)
    except Exception as exc:  # noqa: BLE001 - whatever quack or the DSL raises, the tower runs without them
        warnings.warn(f"stitch-clip: quack's fused fc1 + quick-GELU GEMM did not run on {device} "
                      f"({type(exc).__name__}: {exc}); CLIP's MLPs stay transformers' own", RuntimeWarning,
                      stacklevel=2)
        return 0
    return fuse_quick_gelu(model)
