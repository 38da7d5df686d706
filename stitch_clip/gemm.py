"""CLIP's MLP input projection, bias and quick-GELU as one GEMM on a Hopper GPU (quack's CuTe-DSL kernels).

Why: compiled without it, the tower runs fc1 as a cuBLAS GEMM and then inductor's bias + quick-GELU kernel, which
reads and writes the [tokens x 3,072] activations through HBM once more in each layer (about a tenth of the tower's
compute). quack's Hopper GEMM takes its epilogue as a Python function: with bias + quick-GELU in it, fc1 costs less
than cuBLAS's GEMM alone, and about 0.7x the GEMM + epilogue pair. The GELU is computed in fp32 on the fp32
accumulator and rounded once.

``ClipImageEncoder.compile`` switches the MLPs (``fuse_where_it_runs``) on a device of compute capability 9.x, in half
precision, with ``quack-kernels`` installed (``pip install 'stitch-clip[hopper]'``); anywhere else the MLP is
transformers' own. The tile configuration is fixed, so an image's features are the same bits in any batch.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import threading
import warnings
from typing import Any

import torch


def _installed(distribution: str, module: str) -> bool:
    try:  # the distribution, not just a module of that name: PyPI's unrelated `quack` also imports as `quack`
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return importlib.util.find_spec(module) is not None


QUACK = _installed("quack-kernels", "quack")
HALF = (torch.float16, torch.bfloat16)
# quack's SM90 tile, the fastest of the configs that build at ViT-B/32's fc1: 128 x 192 output tiles, two consumer
# warpgroups in ping-pong, clusters of two along M; fixed (not autotuned), so every run launches the same kernel
CONFIG = {"tile_m": 128, "tile_n": 192, "pingpong": True, "cluster_m": 2, "cluster_n": 1}
_BUILT: dict[str, Any] = {}
_BUILDING = threading.Lock()  # prepare loads and checks the encoder on one thread and encodes on another
_FUSED_CLASSES: dict[type, type] = {}  # a CLIP MLP class -> its fused subclass (one per class, not per module)


def hopper(device: torch.device | str) -> bool:
    """Whether ``device`` is a CUDA device of compute capability 9.x and quack is installed (where the GEMM runs)."""
    device = torch.device(device)
    return (QUACK and device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device)[0] == 9)


def _kernel() -> tuple[Any, Any]:
    """quack's epilogue GEMM for ``quick_gelu(x @ w.T + b)`` and its pinned config, built at the first call."""
    with _BUILDING:
        if not _BUILT:
            from quack.activation import quick_gelu  # optional: quack ([hopper] extra)
            from quack.epilogue.frontend import gemm_epilogue  # optional: quack ([hopper] extra)
            from quack.epilogue.ops import RowVecLoad  # optional: quack ([hopper] extra)
            from quack.gemm_config import GemmConfig  # optional: quack ([hopper] extra)

            # the bias pinned as a row vector: quack infers it from the shapes, ambiguous where rows == width
            @gemm_epilogue(ops={"bias": RowVecLoad("bias")})
            def bias_quick_gelu(acc, bias):
                return {"D": quick_gelu(acc + bias)}

            config = GemmConfig(**CONFIG, is_dynamic_persistent=False, device_capacity=9)
            _BUILT.update(mod=bias_quick_gelu, config=config)
    return _BUILT["mod"], _BUILT["config"]


@torch.library.custom_op("stitch_clip::linear_quick_gelu", mutates_args=())
def linear_quick_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``quick_gelu(x @ weight.T + bias)`` (CLIP's ``x * sigmoid(1.702 x)``) as one GEMM: x [..., K], weight [N, K],
    bias [N], all CUDA tensors of one half-precision dtype, K and N multiples of 8."""
    if not x.numel():
        return x.new_empty((*x.shape[:-1], weight.shape[0]))
    mod, config = _kernel()
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    with torch.cuda.device(x.device):  # quack launches on the current device's stream: the input's
        out = mod(flat, weight.t(), bias=bias.view(1, -1), config=config, tuned=False)["D"]
    return out.view(*x.shape[:-1], weight.shape[0])


@linear_quick_gelu.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class FusedQuickGeluMLP(torch.nn.Module):
    """A CLIP MLP (``fc1``, quick-GELU, ``fc2``) whose fc1 + bias + GELU run as ``linear_quick_gelu`` on CUDA half
    inputs without autograd (the op has no backward; the encoder is frozen and encodes under ``no_grad``); any other
    call goes through the class it was switched from (``fuse_quick_gelu``)."""

    fc1: torch.nn.Linear
    fc2: torch.nn.Linear

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x, weight = hidden_states, self.fc1.weight
        if x.is_cuda and x.dtype in HALF and x.dtype == weight.dtype and x.numel() and not torch.is_grad_enabled():
            return self.fc2(torch.ops.stitch_clip.linear_quick_gelu(x, weight, self.fc1.bias))
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


def fused_count(model: Any) -> int:
    """How many MLPs of ``model`` are ``FusedQuickGeluMLP`` now."""
    return sum(isinstance(module, FusedQuickGeluMLP) for module in model.modules())


def unfuse_quick_gelu(model: Any) -> int:
    """Switch every MLP ``fuse_quick_gelu`` switched back to the class it had; the number switched."""
    original = {fused: cls for cls, fused in _FUSED_CLASSES.items()}
    switched = 0
    for module in model.modules():
        if type(module) in original:
            module.__class__ = original[type(module)]
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


def quick_gelu_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``quick_gelu(x @ weight.T + bias)`` in float32 with torch's own ops (what the fused GEMM must match)."""
    y = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    return y * torch.sigmoid(1.702 * y)


def check(fc1: torch.nn.Linear) -> None:
    """Run ``linear_quick_gelu`` once on 256 random rows with ``fc1``'s weight and a random bias (the kernel the tower
    will use, built now) and compare it with ``quick_gelu_reference``; raises where it fails or disagrees."""
    g = torch.Generator(device=fc1.weight.device).manual_seed(0)
    dtype, device = fc1.weight.dtype, fc1.weight.device
    x = torch.randn(256, fc1.in_features, generator=g, device=device).to(dtype)
    bias = torch.randn(fc1.out_features, generator=g, device=device).to(dtype)
    got = linear_quick_gelu(x, fc1.weight, bias).float()
    want = quick_gelu_reference(x, fc1.weight, bias)
    if not torch.allclose(got, want, atol=5e-2, rtol=5e-2):
        raise RuntimeError(f"linear_quick_gelu on a [{fc1.out_features} x {fc1.in_features}] fc1 differs from torch's "
                           f"arithmetic by up to {(got - want).abs().max().item():.3g}")


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
