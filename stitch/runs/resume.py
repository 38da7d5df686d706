"""What a resume must find unchanged: the resolved recipe and the prepared data a checkpoint was written with. A
checkpoint records both (``recipe.yaml`` and the manifest's sha256); ``--resume`` against anything else is refused,
naming the recipe fields or the data file that changed, before any tensor is read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from stitch.runs.digest import file_sha256

RECIPE_NAME = "recipe.yaml"  # the resolved recipe, inside each step directory


class ResumeMismatchError(ValueError):
    """The recipe or the data differs from the checkpoint's; the message names what changed."""


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, child in value.items():
            out.update(_flat(child, f"{prefix}{key}."))
        return out or {prefix.rstrip("."): {}}
    return {prefix.rstrip("."): value}


def changed_fields(before: str, after: str) -> list[str]:
    """The dotted fields whose values differ between two resolved recipes, as ``field: old -> new``."""
    old, new = _flat(yaml.safe_load(before) or {}), _flat(yaml.safe_load(after) or {})
    return [f"{key}: {old.get(key, '(absent)')!r} -> {new.get(key, '(absent)')!r}"
            for key in sorted(old.keys() | new.keys()) if old.get(key, "(absent)") != new.get(key, "(absent)")]


def data_digest(manifest: Path) -> str:
    """The prepared data's identity: the manifest's sha256 (it names every row and its feature shard's digest)."""
    return file_sha256(manifest) if Path(manifest).is_file() else ""


def check_resumable(step_dir: Path, recipe_yaml: str | None, recipe_digest: str, manifest: Path) -> None:
    """Refuse resuming ``step_dir`` with another recipe (naming the changed fields) or other data (naming the
    manifest); checkpoints that did not record one of them are not checked for it."""
    state = json.loads((Path(step_dir) / "trainer_state.json").read_text())
    recorded = state.get("recipe_digest")
    if recorded and recipe_digest and recorded != recipe_digest:
        saved = Path(step_dir) / RECIPE_NAME
        changes = changed_fields(saved.read_text(), recipe_yaml) if saved.is_file() and recipe_yaml else []
        what = "; ".join(changes[:5]) + (f"; and {len(changes) - 5} more" if len(changes) > 5 else "")
        raise ResumeMismatchError(
            f"--resume from {step_dir}: the recipe changed since that checkpoint ({what or 'digest differs'}); "
            f"resume with the recipe it was written with, or start a fresh run (another --out)")
    data = state.get("data_digest")
    if data and data != data_digest(manifest):
        raise ResumeMismatchError(
            f"--resume from {step_dir}: the prepared data changed since that checkpoint ({manifest} has sha256 "
            f"{data_digest(manifest)[:12]}..., the checkpoint was written with {data[:12]}...); resume on the data it "
            f"was trained on, or start a fresh run (another --out)")
