"""Sample boundaries for packed rows in recurrent layers: the pieces every hybrid model binding shares.

Attention layers keep packed samples apart through ``stitch_varlen`` (``stitch.kernels.attention``), which
``StitchedModel`` feeds these same sample starts. Recurrent layers (Gated DeltaNet, Mamba-2) and their short causal convolutions need the sample starts
(``cu_seqlens``) instead, and fla's varlen kernels take them for one flattened row. This module finds whether fla's
kernels run here (on a GPU where they do not, it says once what to install), turns position ids into
``cu_seqlens``, flattens packed rows into one for a decoder, and runs a depthwise causal conv per sample (fla on a
GPU, a PyTorch reference otherwise).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import logging
import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F


@functools.cache
def fla_kernels_importable() -> str | None:
    """None when fla's kernels import, else why not (one line)."""
    if importlib.util.find_spec("fla") is None:
        return "flash-linear-attention is not installed"
    try:
        pass  # optional: fla ([kernels] extra); noqa: F401
    except Exception as exc:  # an import-time failure (e.g. Triton too old) is reported, not raised
        return f"flash-linear-attention does not import: {type(exc).__name__}: {str(exc)[:200]}"
    return None


# fla 0.6.0 refuses its gated chunk backward (Gated DeltaNet, simple GLA) on Hopper with Triton >= 3.4 and < 3.7.1:
# those Tritons compute it wrong there
FLA_HOPPER_TRITON_BAD = ((3, 4, 0), (3, 7, 1))
TRITON_PIN = 'pip install "triton>=3.7.1"'

log = logging.getLogger("stitch")
_SAID: set[str] = set()


def release(version: str) -> tuple[int, ...]:
    """The leading numbers of a version string: "3.6.0+git9a1b" -> (3, 6, 0)."""
    found = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in found.group(0).split(".")) if found else ()


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def cuda_capability() -> tuple[int, int] | None:
    """The current CUDA device's compute capability, or None without one."""
    if not torch.cuda.is_available():
        return None
    try:
        return tuple(torch.cuda.get_device_capability())
    except (RuntimeError, AssertionError):  # a device that is announced but cannot be queried
        return None


def fla_triton_problem() -> str | None:
    """On a Hopper GPU (compute capability 9.x), one line when the installed Triton is one fla refuses, naming the
    pin to install; None elsewhere (other GPUs, CPU, a Triton outside the bad range)."""
    version = installed_version("triton") or installed_version("pytorch-triton")  # the latter: torch nightlies
    low, high = FLA_HOPPER_TRITON_BAD
    if version is None or not low <= release(version) < high:
        return None
    capability = cuda_capability()
    if capability is None or capability[0] != 9:
        return None
    return (f"Triton {version} on a Hopper GPU (sm_{capability[0]}{capability[1]}): flash-linear-attention refuses "
            f"its gated backward with Triton < 3.7.1, so the hybrid layers run the PyTorch reference (several times "
            f"slower); install: {TRITON_PIN}")


def fla_kernels_usable() -> str | None:
    """None when fla's kernels import and train correctly on this machine, else why not (one line)."""
    return fla_kernels_importable() or fla_triton_problem()


def varlen_kernels_ready() -> bool:
    """True when packed rows of a hybrid model can run with sample boundaries: a CUDA device and fla's kernels
    (with a Triton they accept)."""
    return torch.cuda.is_available() and fla_kernels_usable() is None


def import_problem(module: str, distribution: str) -> str | None:
    """None when ``module`` imports, else why not (one line); fla is asked through ``fla_kernels_usable``."""
    if module == "fla":
        return fla_kernels_usable()
    if importlib.util.find_spec(module) is None:
        return f"{distribution} is not installed"
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import-time failure is the answer
        return f"{distribution} does not import: {type(exc).__name__}: {str(exc)[:200]}"
    return None


def kernel_fallback(extra: str, modules: Mapping[str, str]) -> str | None:
    """One line when a CUDA device runs PyTorch reference code because kernels that a plugin's extra installs are
    missing or unusable: why, and the install line (the extra; the Triton pin when Triton is all that is wrong).
    None on CPU, where the reference is the expected path, and where every kernel runs. ``modules``: import name ->
    the distribution that provides it."""
    if not torch.cuda.is_available():
        return None
    problems = [why for module, package in sorted(modules.items()) if (why := import_problem(module, package))]
    if not problems:
        return None
    if problems == [fla_triton_problem()]:  # fla and the rest are there: only Triton is wrong
        return f"{extra}: {problems[0]}"
    return (f"{extra}: {'; '.join(problems)}; the model runs PyTorch reference code on this GPU (several times "
            f"slower); install: pip install \"{extra}\"")


def warn_kernel_fallback(extra: str, modules: Mapping[str, str]) -> str | None:
    """``kernel_fallback``'s line as a warning, at most once per process for each line; returns the line (None when
    nothing falls back)."""
    line = kernel_fallback(extra, modules)
    if line is not None and line not in _SAID:
        _SAID.add(line)
        log.warning(line)
    return line


def cu_seqlens_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """Sample starts of the flattened batch (every position id 0 starts one; every row starts with 0) + the end."""
    flat = position_ids.reshape(-1)
    if flat.numel() and int(flat[0]) != 0:
        raise ValueError(f"packed rows must start a sample at position 0, got position id {int(flat[0])}")
    starts = (flat == 0).nonzero().squeeze(-1)
    end = torch.tensor([flat.numel()], device=flat.device, dtype=starts.dtype)
    return torch.cat([starts, end]).to(torch.int32)


def varlen_kwargs(position_ids: torch.Tensor) -> dict[str, Any]:
    """transformers' flash-attention kwargs for packed rows: sample starts and the longest sample."""
    cu = cu_seqlens_from_positions(position_ids)
    longest = int((cu[1:] - cu[:-1]).max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def segments(total: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, total)]
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def reference_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                   cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """Depthwise causal conv of x [B, T, D] with weight [D, W], restarted at every sample start."""
    out = torch.empty_like(x)
    for s, e in segments(x.shape[1], cu_seqlens):
        seg = x[:, s:e].transpose(1, 2).to(weight.dtype)
        y = F.conv1d(seg, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=seg.shape[1])
        y = y[:, :, : e - s]
        if activation in ("silu", "swish"):
            y = F.silu(y)
        elif activation is not None:
            raise ValueError(f"conv activation {activation!r}: expected 'silu', 'swish' or None")
        out[:, s:e] = y.transpose(1, 2).to(x.dtype)
    return out


def fla_seqlens(cu_seqlens: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
    """``cu_seqlens`` as fla's varlen kernels take it: int64 on the device plus a host copy, made once per tensor.

    Why: fla derives its chunk indices from ``cu_seqlens`` and caches them by the tensor's identity. Without a host
    copy each derivation reads the device (a sync that drains the launch queue), and a fresh ``.long()`` per layer
    misses that cache, so a 42-layer hybrid synchronised ~40 times a step. Memoised on the tensor itself, every
    layer of one forward and its backward pass the same two objects: one copy to the host per forward, no sync
    inside fla."""
    if cu_seqlens is None:
        return {"cu_seqlens": None, "cu_seqlens_cpu": None}
    cached = getattr(cu_seqlens, "_stitch_fla_seqlens", None)
    if cached is None:
        wide = cu_seqlens if cu_seqlens.dtype == torch.int64 else cu_seqlens.long()
        attach_host_copy(cu_seqlens, wide.cpu(), wide)
        cached = cu_seqlens._stitch_fla_seqlens
    return cached


def attach_host_copy(cu_seqlens: torch.Tensor, host: torch.Tensor, device_wide: torch.Tensor) -> None:
    """Give ``fla_seqlens`` its answer for ``cu_seqlens`` ahead of time: ``host`` (int64 on the host) and
    ``device_wide`` (the same on the device), for sample starts that were found on the host before the batch moved,
    so no layer copies them back."""
    device_wide._stitch_host = host  # read by fla's chunk offsets (``known_chunk_offsets``)
    cu_seqlens._stitch_fla_seqlens = {"cu_seqlens": device_wide, "cu_seqlens_cpu": host}
    if device_wide.is_cuda:
        _offsets_known_on_host()


class _HostEnd(torch.Tensor):
    """Chunk offsets on the device whose last value (the total chunk count) is also known on the host, so
    ``offsets[-1].item()`` answers without reading the device. Every op on it gives a plain tensor."""

    _stitch_end: int

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, int) and index in (-1, self.shape[0] - 1) and self.dim() == 1:
            return _Known(self._stitch_end)
        return torch.Tensor.__getitem__(self.as_subclass(torch.Tensor), index)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


class _Known:
    def __init__(self, value: int) -> None:
        self.value = value

    def item(self) -> int:
        return self.value


def known_chunk_offsets(original: Any) -> Any:
    """``original`` (fla's ``prepare_chunk_offsets(cu_seqlens, chunk_size)``: each sample's first chunk, plus the
    total) answering with a ``_HostEnd`` when ``cu_seqlens`` carries its host copy: fla's chunked state kernels
    read the total as ``offsets[-1].item()`` to size their output, one device read per call, three per Mamba-2
    layer and step (forward, and backward's recompute and state gradient)."""

    @functools.wraps(original)
    def prepare_chunk_offsets(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
        offsets = original(cu_seqlens, chunk_size)
        host = getattr(cu_seqlens, "_stitch_host", None)
        if host is None or offsets.dim() != 1:
            return offsets
        known = offsets.as_subclass(_HostEnd)
        known._stitch_end = int(((host[1:] - host[:-1] + chunk_size - 1) // chunk_size).sum())
        return known

    prepare_chunk_offsets._stitch_known_end = True
    return prepare_chunk_offsets


@functools.cache
def _offsets_known_on_host() -> bool:
    """Install ``known_chunk_offsets`` where fla's chunked state kernels (``fla.ops.common.chunk_h``) look it up;
    False where that module or name is missing (another fla: nothing changes, its reads stay)."""
    try:
        from fla.ops.common import chunk_h  # optional: fla ([kernels] extra)
    except Exception:  # noqa: BLE001 - an fla that does not import here has nothing to patch
        return False
    original = getattr(chunk_h, "prepare_chunk_offsets", None)
    if original is None or getattr(original, "_stitch_known_end", False):
        return original is not None
    chunk_h.prepare_chunk_offsets = known_chunk_offsets(original)
    return True


def fla_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
             cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    from fla.modules.causal_conv1d import causal_conv1d  # optional: fla ([kernels] extra)

    y, _ = causal_conv1d(x, weight=weight, bias=bias, activation=activation, **fla_seqlens(cu_seqlens))
    return y


def flatten_packed_rows(decoder: torch.nn.Module) -> None:
    """Make ``decoder`` (a transformers base model) run packed calls as one row carrying ``cu_seq_lens_*``.

    A packed call is one without attention mask or cache whose 2-D position ids reset at each sample. Its rows are
    concatenated (each row starts a sample, so nothing joins), the sample starts ride along as transformers'
    flash-attention kwargs to every layer, and the output is reshaped back to the rows. Unpacked and cached calls
    pass through unchanged.
    """
    if getattr(decoder, "_stitch_flatten_packed", False):
        return

    def before(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        pos, embeds, ids = kwargs.get("position_ids"), kwargs.get("inputs_embeds"), kwargs.get("input_ids")
        if (args or (embeds is None and ids is None) or pos is None or pos.dim() != 2
                or kwargs.get("attention_mask") is not None or kwargs.get("past_key_values") is not None
                or kwargs.get("use_cache") or "cu_seq_lens_q" in kwargs):
            return None
        rows, width = pos.shape
        module._stitch_rows = (rows, width)
        flat = {"position_ids": pos.reshape(1, rows * width), **varlen_kwargs(pos)}
        if embeds is not None:
            flat["inputs_embeds"] = embeds.reshape(1, rows * width, -1)
        else:
            flat["input_ids"] = ids.reshape(1, rows * width)
        return args, {**kwargs, **flat}

    def after(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        shape = module.__dict__.pop("_stitch_rows", None)
        if shape is not None:
            output.last_hidden_state = output.last_hidden_state.reshape(*shape, -1)
        return output

    decoder.register_forward_pre_hook(before, with_kwargs=True)
    decoder.register_forward_hook(after, with_kwargs=True)
    decoder._stitch_flatten_packed = True


def decode_cache_kwargs(cache_params: Any, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The keyword arguments that hand a recurrent layer's call to transformers' own forward when it carries a
    decode cache (``cache_params``, or ``cache`` from transformers 5.24 on); None for a call without one, which a
    plugin's kernel path may take. A cached call must reach transformers: the kernel paths keep no state."""
    if cache_params is None and kwargs.get("cache") is None:
        return None
    return kwargs if cache_params is None else {**kwargs, "cache_params": cache_params}
