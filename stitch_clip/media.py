"""A raw image value as the CLIP plugin receives it (bytes, datasets' ``{"bytes", "path"}`` dict or a path): unwrapped
to its bytes or path, or read to bytes once."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def unwrap(value: Any) -> Any:
    """A ``{"bytes", "path"}`` dict (datasets' Image) as its bytes, or its path when it has none; else ``value``."""
    if isinstance(value, dict):  # bytes win; the path is only opened when there are none
        found = value["bytes"] if value.get("bytes") is not None else value.get("path")
        if not found:
            raise ValueError("image dict has neither 'bytes' nor 'path'")
        return found
    return value


def media_bytes(value: Any) -> Any:
    """``value`` (bytes, a ``{"bytes", "path"}`` dict or a path) as bytes, the file read once; anything else as
    it is (``ClipGeometry`` reports what it cannot decode)."""
    value = unwrap(value)
    if isinstance(value, str | Path):
        with open(value, "rb") as fh:
            return fh.read()
    return value
