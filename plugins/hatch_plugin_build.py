"""Hatch build hook shared by the first-party plugins: put the plugin's package into its sdist and wheel.

In a checkout the package lives at the repository root (``../../stitch_qwen``), beside the core. The sdist copies
it in, so a wheel built from the sdist finds it at the sdist's root. Editable installs skip this hook and get the
repository root on sys.path instead (``dev-mode-dirs``), so edits are seen without reinstalling (a force-include
in an editable wheel would copy the package and shadow the checkout).
"""

from __future__ import annotations

from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict) -> None:
        if version == "editable":
            return
        package = self.metadata.name.replace("-", "_")
        root = Path(self.root)
        for source in (root / package, (root / ".." / ".." / package).resolve()):
            if (source / "__init__.py").is_file():
                break
        else:
            raise FileNotFoundError(f"plugin package {package!r} is neither in {root} (an sdist) nor at "
                                    f"{(root / '..' / '..' / package).resolve()} (a checkout)")
        if source != root / package:  # an sdist already holds it at its root, where the wheel selects it
            build_data["force_include"][str(source)] = package
        if self.target_name == "sdist":  # the plugin's copy is a symlink to this shared file: ship the file itself
            build_data["force_include"][str(Path(__file__).resolve())] = "hatch_plugin_build.py"
