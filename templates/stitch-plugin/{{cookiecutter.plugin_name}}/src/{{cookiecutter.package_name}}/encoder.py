"""The {{ cookiecutter.modality }} encoder: raw dataset values -> items -> frozen features [items, tokens, width].

It ships a small frozen *reference* encoder (fixed-seed random weights, written once as a local safetensors
snapshot) so everything runs with no download. Put your pretrained encoder in at the spots marked ">>>".
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from stitch.api import EncoderSpec, ModelSource
from torch import nn
from torch.nn import functional as F

MODALITY = "{{ cookiecutter.modality }}"
ENCODER_NAME = "{{ cookiecutter.__encoder_name }}"

# The output contract: every item becomes TOKENS_PER_ITEM soft tokens of FEATURE_WIDTH features. The feature
# cache, the projector and every artifact record these numbers; a projector trained for one contract is
# refused by another. If your encoder has a different shape, change them here and re-run `stitch prepare`.
TOKENS_PER_ITEM = {{ cookiecutter.tokens_per_item }}
FEATURE_WIDTH = {{ cookiecutter.feature_width }}

# >>> 4. The OpenAI chat content-part type(s) whose value `stitch serve` hands to decode_item:
# "input_audio", "image_url", "video_url", or a type of your own (e.g. "input_{{ cookiecutter.modality }}").
# A placeholder: change it to what your clients send. An empty tuple means the encoder cannot be served
# (`stitch infer --media` still works).
CONTENT_PARTS = ("input_audio",)

# Reference encoder geometry: a signal is resampled to TOKENS_PER_ITEM patches of PATCH_SIZE samples.
PATCH_SIZE = 16
REFERENCE_SEED = 0
MIN_LENGTH = 2
NPY_MAGIC = b"\x93NUMPY"


# ------------------------------------------------------------------------------------------------------
# >>> 1. Raw dataset value -> item. Change this to read your data format.
# ------------------------------------------------------------------------------------------------------
def decode_item(value: Any) -> torch.Tensor:
    """One item as a 1-D float32 tensor, from what a dataset row holds.

    Accepted: a list/tuple of numbers, a numpy array or torch tensor, a path to a ``.npy`` file or to a
    text file of numbers (``.txt``/``.csv``, whitespace or comma separated), the raw bytes of a ``.npy``
    file, or a ``{"bytes": ..., "path": ...}`` dict (how Hugging Face ``datasets`` stores files).
    Raises ``ValueError`` naming the problem on anything corrupt: unreadable bytes, a missing file,
    non-numeric or non-finite values, the wrong number of dimensions, or fewer than MIN_LENGTH values.
    """
    try:
        array = _as_array(value)
    except (OSError, EOFError, TypeError) as exc:
        raise ValueError(f"cannot decode {MODALITY} item: {type(exc).__name__}: {exc}") from exc
    if array.ndim != 1:
        raise ValueError(
            f"cannot decode {MODALITY} item: expected a 1-D signal, got an array of shape "
            f"{tuple(array.shape)} (for several channels, change decode_item and the encoder in encoder.py)"
        )
    if array.shape[0] < MIN_LENGTH:
        raise ValueError(
            f"cannot decode {MODALITY} item: it has {array.shape[0]} values; at least {MIN_LENGTH} are needed"
        )
    bad = np.flatnonzero(~np.isfinite(array))
    if bad.size:
        raise ValueError(
            f"cannot decode {MODALITY} item: {bad.size} non-finite value(s), the first at index {bad[0]} "
            f"({array[bad[0]]})"
        )
    return torch.from_numpy(array.astype(np.float32))


def _as_array(value: Any) -> np.ndarray:
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            value = value["bytes"]
        elif value.get("path"):
            value = value["path"]
        else:
            raise ValueError(
                f"cannot decode {MODALITY} item: a file dict needs 'bytes' or 'path', got {sorted(value)}"
            )
    if isinstance(value, bytes | bytearray | memoryview):
        return _load_npy(bytes(value), f"{len(value)} bytes")
    if isinstance(value, str | Path):
        path = Path(value)
        if not path.is_file():
            raise ValueError(f"cannot decode {MODALITY} item: no such file {str(path)!r}")
        if path.suffix == ".npy":
            return _load_npy(path.read_bytes(), f"file {str(path)!r}")
        try:
            return np.array(path.read_text().replace(",", " ").split(), dtype=np.float64)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(
                f"cannot decode {MODALITY} item: file {str(path)!r} is not numbers ({exc})"
            ) from exc
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            raise ValueError(f"cannot decode {MODALITY} item: dtype {value.dtype} is not real numbers")
        return value.detach().cpu().to(torch.float64).numpy()
    if isinstance(value, np.ndarray | list | tuple):
        try:
            return _numeric(np.asarray(value, dtype=np.float64))
        except ValueError as exc:
            raise ValueError(f"cannot decode {MODALITY} item: values are not numbers ({exc})") from exc
    raise ValueError(
        f"cannot decode {MODALITY} item: expected numbers, an array, a file path or .npy bytes; "
        f"got {type(value).__name__}"
    )


def _load_npy(data: bytes, what: str) -> np.ndarray:
    if not data.startswith(NPY_MAGIC):
        raise ValueError(f"cannot decode {MODALITY} item: {what} is not a .npy array (no .npy header)")
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise ValueError(
            f"cannot decode {MODALITY} item: {what} is not a readable .npy array ({exc})"
        ) from exc
    return _numeric(array)


def _numeric(array: np.ndarray) -> np.ndarray:
    if array.dtype.kind not in "biuf":
        raise ValueError(f"cannot decode {MODALITY} item: values have dtype {array.dtype}, not real numbers")
    return array.astype(np.float64, copy=False)


# ------------------------------------------------------------------------------------------------------
# 2. The reference encoder: frozen, deterministic, built locally. Not a trained model, but its features
#    follow the signal (a random projection of each patch), so the whole pipeline can run end to end.
# ------------------------------------------------------------------------------------------------------
class ReferenceEncoderModule(nn.Module):
    """Patch embedding + position embedding + one residual MLP + LayerNorm."""

    def __init__(self, tokens: int, width: int, patch: int) -> None:
        super().__init__()
        self.tokens, self.patch = tokens, patch
        self.patch_embed = nn.Linear(patch, width)
        self.position = nn.Parameter(torch.randn(tokens, width) * 0.02)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.norm = nn.LayerNorm(width)

    def forward(self, signals: torch.Tensor) -> torch.Tensor:  # [B, tokens * patch] -> [B, tokens, width]
        hidden = self.patch_embed(signals.view(signals.shape[0], self.tokens, self.patch)) + self.position
        return self.norm(hidden + self.mlp(hidden))


class {{ cookiecutter.__class_name }}:
    """A loaded, frozen encoder: ``encode(items)`` gives ``[len(items), TOKENS_PER_ITEM, FEATURE_WIDTH]``."""

    def __init__(self, module: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        self.module = module.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.device, self.dtype = device, dtype

    # no_grad rather than inference_mode: inference tensors could not later meet a trainable projector
    # under autograd (payload.build during GRPO), and the encoder is frozen either way.
    @torch.no_grad()
    def encode(self, items: list[torch.Tensor]) -> torch.Tensor:
        if not items:
            raise ValueError(f"{ENCODER_NAME}: encode() needs at least one item")
        length = TOKENS_PER_ITEM * PATCH_SIZE
        signals = []
        for item in items:
            # Each signal is resampled to a fixed length and standardized, so any length and scale fit.
            # If absolute scale matters in your domain, keep it (e.g. append it as a feature) instead.
            resampled = F.interpolate(item.float().view(1, 1, -1), length, mode="linear", align_corners=True)
            signal = resampled.view(length)
            signals.append((signal - signal.mean()) / signal.std().clamp_min(1e-6))
        features = self.module(torch.stack(signals).to(self.device, self.dtype))
        if tuple(features.shape[1:]) != (TOKENS_PER_ITEM, FEATURE_WIDTH):
            raise ValueError(
                f"{ENCODER_NAME} produced features of shape {tuple(features.shape[1:])}; it declares "
                f"({TOKENS_PER_ITEM}, {FEATURE_WIDTH}) — fix TOKENS_PER_ITEM / FEATURE_WIDTH in encoder.py"
            )
        return features


def build_reference_snapshot(out_dir: Path) -> None:
    """Write the reference encoder (seeded random weights) as ``model.safetensors`` + ``config.json``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(REFERENCE_SEED)
        module = ReferenceEncoderModule(TOKENS_PER_ITEM, FEATURE_WIDTH, PATCH_SIZE)
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(out_dir / "model.safetensors"))
    config = {
        "architecture": "ReferenceEncoderModule",
        "tokens_per_item": TOKENS_PER_ITEM,
        "feature_width": FEATURE_WIDTH,
        "patch_size": PATCH_SIZE,
        "seed": REFERENCE_SEED,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_encoder(
    source: ModelSource, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> {{ cookiecutter.__class_name }}:
    """Load the encoder from a local snapshot directory (safetensors weights only, no remote code)."""
    location = source.pretrained_kwargs()["pretrained_model_name_or_path"]
    snapshot = Path(location)
    if not (snapshot / "config.json").is_file() or not (snapshot / "model.safetensors").is_file():
        raise ValueError(
            f"{ENCODER_NAME}: {location!r} is not a snapshot directory with config.json and model.safetensors"
        )
    config = json.loads((snapshot / "config.json").read_text())
    declared = {"tokens_per_item": TOKENS_PER_ITEM, "feature_width": FEATURE_WIDTH, "patch_size": PATCH_SIZE}
    found = {key: config.get(key) for key in declared}
    if found != declared:
        raise ValueError(
            f"{ENCODER_NAME}: snapshot {str(snapshot)!r} was built for {found}; this code declares {declared}"
        )
    module = ReferenceEncoderModule(TOKENS_PER_ITEM, FEATURE_WIDTH, PATCH_SIZE)
    # strict: a missing or unexpected weight is refused by name, never silently left at its initial value
    module.load_state_dict(load_file(str(snapshot / "model.safetensors")), strict=True)
    return {{ cookiecutter.__class_name }}(module, torch.device(device), dtype)


# ------------------------------------------------------------------------------------------------------
# >>> 3. Your pretrained encoder goes here.
#
# a) Point SOURCE at its weights, pinned: ModelSource(repo_id="your-org/your-encoder", revision="<commit
#    sha>") for a Hugging Face repo, or ModelSource(local_path="/data/models/your-encoder") for a directory.
# b) Make load_encoder return an object whose encode(items) gives [len(items), TOKENS_PER_ITEM,
#    FEATURE_WIDTH] (pool or crop its sequence to a fixed token count), loading safetensors only and never
#    running remote code. With a transformers model it looks like:
#
#        from transformers import AutoModel
#        model = AutoModel.from_pretrained(**source.pretrained_kwargs(), use_safetensors=True,
#                                          trust_remote_code=False)
#
# c) Set TOKENS_PER_ITEM and FEATURE_WIDTH above to what it produces, and run `pytest` in this project.
# Keep the reference encoder registered under another name (e.g. "{{ cookiecutter.modality }}-reference")
# if you want tests that run offline.
# ------------------------------------------------------------------------------------------------------
SOURCE = ModelSource(
    builder=build_reference_snapshot,
    builder_key=f"{ENCODER_NAME}-reference-{TOKENS_PER_ITEM}x{FEATURE_WIDTH}-p{PATCH_SIZE}-v1",
)

ENCODER = EncoderSpec(
    name=ENCODER_NAME,
    modality=MODALITY,
    feature_width=FEATURE_WIDTH,
    tokens_per_item=TOKENS_PER_ITEM,
    source=SOURCE,
    load=load_encoder,
    decode_item=decode_item,
    payload=MODALITY,  # the rollout payload registered in __init__.py carries these features to engines
    content_parts=CONTENT_PARTS,
    description=f"reference {MODALITY} encoder (fixed-seed random weights, built locally): "
    f"{TOKENS_PER_ITEM} tokens x {FEATURE_WIDTH} per item",
)
