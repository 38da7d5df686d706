"""Hatch build hook shared by the first-party plugins: package ../../<name> into the standard wheel only.

A force-include in pyproject would also copy the package into the *editable* wheel, which then shadows
the source tree (edits unseen). Editable installs instead get the repository root via dev-mode-dirs.
"""

from __future__ import annotations

from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict) -> None:
        if version != "standard":
            return
        package = self.metadata.name.replace("-", "_")
        source = (Path(self.root) / ".." / ".." / package).resolve()
        if not (source / "__init__.py").is_file():
            raise FileNotFoundError(f"plugin package {package!r} not found at {source}")
        build_data["force_include"][str(source)] = package
