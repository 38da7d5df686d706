"""Hatch build hook: put templates/ into the standard wheel as stitch/templates (not the editable one)."""

from __future__ import annotations

from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict) -> None:
        if version == "standard":
            build_data["force_include"][str(Path(self.root) / "templates")] = "stitch/templates"
