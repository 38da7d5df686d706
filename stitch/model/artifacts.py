"""The projector artifact: ``mm-projector.safetensors`` + ``manifest.json`` (provenance, per-tensor sha256).

Written atomically (a temp directory renamed into place); loading refuses any provenance field that
differs from what the caller expects, naming the field, and any tensor whose checksum does not match.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from stitch.model.projector import projector_input_width

WEIGHTS_NAME = "mm-projector.safetensors"
MANIFEST_NAME = "manifest.json"
FORMAT = "stitch.projector/1"
# what every artifact records; callers may add more (e.g. "step"), never drop one of these
PROVENANCE_FIELDS = (
    "encoder",
    "encoder_id",
    "encoder_revision",
    "feature_width",
    "tokens_per_item",
    "projector_type",
    "base_model",
    "base_model_id",
    "base_model_revision",
    "hidden_size",
    "sentinel_ids",
    "stage",
)
_RESERVED = ("format", "tensors")


class ArtifactError(ValueError):
    """A projector artifact is missing, corrupt, or does not fit; the message names the file, field or tensor."""


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes (row-major, as stored)."""
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(raw.tobytes()).hexdigest()


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value))


def save_projector_artifact(
    directory: Path | str, projector: nn.Module | Mapping[str, torch.Tensor], provenance: Mapping[str, Any]
) -> Path:
    """Write ``directory/{mm-projector.safetensors, manifest.json}`` atomically; returns ``directory``.

    ``provenance`` must hold every field in ``PROVENANCE_FIELDS``; a module's input width must match
    ``feature_width``.
    """
    directory = Path(directory)
    missing = [f for f in PROVENANCE_FIELDS if f not in provenance]
    if missing:
        raise ArtifactError(f"projector artifact {directory}: provenance lacks field(s) {missing}")
    clash = [f for f in _RESERVED if f in provenance]
    if clash:
        raise ArtifactError(f"projector artifact {directory}: provenance may not set reserved field(s) {clash}")
    if isinstance(projector, nn.Module):
        width = projector_input_width(projector)
        if width != provenance["feature_width"]:
            raise ArtifactError(
                f"projector artifact {directory}: field 'feature_width': the projector takes {width}, "
                f"provenance says {provenance['feature_width']}"
            )
        state = projector.state_dict()
    else:
        state = dict(projector)
    tensors = {name: t.detach().cpu().contiguous() for name, t in state.items()}
    manifest = {
        "format": FORMAT,
        **_jsonable(dict(provenance)),
        "tensors": {
            name: {"sha256": tensor_sha256(t), "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
            for name, t in sorted(tensors.items())
        },
    }
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": FORMAT})
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        _replace_dir(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def _replace_dir(new: Path, final: Path) -> None:
    """Rename ``new`` onto ``final``; an existing ``final`` is moved aside first, then removed."""
    if not final.exists():
        os.rename(new, final)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
    os.rename(final, old / final.name)
    try:
        os.rename(new, final)
    except OSError:
        os.rename(old / final.name, final)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def read_projector_manifest(directory: Path | str) -> dict[str, Any]:
    """The artifact's ``manifest.json``, checked for format and required fields."""
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise ArtifactError(f"projector artifact {directory}: {path.name} is missing")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"projector artifact {path}: not valid JSON ({exc})") from exc
    if manifest.get("format") != FORMAT:
        raise ArtifactError(f"projector artifact {path}: field 'format': expected {FORMAT!r}, got {manifest.get('format')!r}")
    missing = [f for f in (*PROVENANCE_FIELDS, "tensors") if f not in manifest]
    if missing:
        raise ArtifactError(f"projector artifact {path}: field(s) {missing} missing")
    return manifest


def check_provenance(manifest: Mapping[str, Any], expected: Mapping[str, Any], where: str = "projector artifact") -> None:
    """Refuse the first field of ``expected`` that the manifest lacks or records differently."""
    for name, want in expected.items():
        if name in _RESERVED:
            raise ArtifactError(f"{where}: field {name!r} cannot be an expectation")
        if name not in manifest:
            raise ArtifactError(f"{where}: field {name!r} expected {want!r}, but the artifact does not record it")
        want_json, have = _jsonable(want), manifest[name]
        if have != want_json:
            raise ArtifactError(f"{where}: field {name!r} expected {want_json!r}, actual {have!r}; refusing to load")


def load_projector_artifact(
    directory: Path | str, expected: Mapping[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """The projector state dict, after checking provenance against ``expected`` and every tensor checksum."""
    directory = Path(directory)
    manifest = read_projector_manifest(directory)
    check_provenance(manifest, expected or {}, f"projector artifact {directory}")
    weights = directory / WEIGHTS_NAME
    if not weights.is_file():
        raise ArtifactError(f"projector artifact {directory}: {WEIGHTS_NAME} is missing")
    state = load_file(str(weights))
    recorded = manifest["tensors"]
    if set(state) != set(recorded):
        raise ArtifactError(
            f"projector artifact {directory}: tensors {sorted(set(state) ^ set(recorded))} are in only one of "
            f"{WEIGHTS_NAME} and {MANIFEST_NAME}"
        )
    for name, tensor in state.items():
        actual = tensor_sha256(tensor)
        if actual != recorded[name]["sha256"]:
            raise ArtifactError(
                f"projector artifact {directory}: tensor {name!r} checksum mismatch (manifest "
                f"{recorded[name]['sha256'][:16]}..., file {actual[:16]}...); the weights are corrupt or were edited"
            )
    return state
