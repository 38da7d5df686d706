"""Scaffolding a new modality plugin from the cookiecutter template ``templates/stitch-plugin``."""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

TEMPLATE_NAME = "stitch-plugin"
MODALITY_PATTERN = re.compile(r"[a-z][a-z0-9_]{0,31}")
INTEGER_FIELDS = ("tokens_per_item", "feature_width")


class ScaffoldError(ValueError):
    """A template value is invalid or the project cannot be written; the message names the value."""


def template_candidates() -> list[Path]:
    """Where the template may live: package data in a wheel, then the checkout of an editable install."""
    package = Path(__file__).resolve().parent
    return [package / "templates" / TEMPLATE_NAME, package.parent / "templates" / TEMPLATE_NAME]


def find_template(candidates: Iterable[Path] | None = None) -> Path:
    """The first candidate directory holding a ``cookiecutter.json``; refuses naming every place looked."""
    tried = list(template_candidates() if candidates is None else candidates)
    for path in tried:
        if (path / "cookiecutter.json").is_file():
            return path
    raise FileNotFoundError(
        f"the {TEMPLATE_NAME!r} template is missing; looked in: {', '.join(str(p) for p in tried)}. "
        "Reinstall stitch (the wheel ships it as stitch/templates) or use a checkout."
    )


def template_defaults(template: Path | None = None) -> dict[str, Any]:
    """The template's variables and their defaults, as cookiecutter.json declares them."""
    return json.loads(((template or find_template()) / "cookiecutter.json").read_text())


def validate_modality(modality: str) -> str:
    if not isinstance(modality, str) or not MODALITY_PATTERN.fullmatch(modality):
        raise ScaffoldError(
            f"modality {modality!r} is not a valid slug: use a lowercase letter, then lowercase letters, "
            "digits or '_' (at most 32 characters), e.g. 'spectrum', 'time_series', 'molecule'"
        )
    return modality


def render_plugin(output_dir: Path, modality: str, **extra: Any) -> Path:
    """Render the modality-plugin template into ``output_dir`` and return the new project's directory.

    ``extra`` sets other template variables (``tokens_per_item``, ``feature_width``, ``plugin_name``,
    ``package_name``, ``author_name``, ...); unknown names and non-positive sizes are refused before any
    file is written, and an existing project directory is never overwritten.
    """
    from cookiecutter.exceptions import (  # optional: cookiecutter ([scaffold] extra)
        CookiecutterException,
        OutputDirExistsException,
    )
    from cookiecutter.main import cookiecutter  # optional: cookiecutter ([scaffold] extra)

    validate_modality(modality)
    template = find_template()
    defaults = template_defaults(template)
    settable = sorted(k for k in defaults if not k.startswith("_") and k != "modality")
    unknown = sorted(set(extra) - set(settable))
    if unknown:
        raise ScaffoldError(f"unknown template variable(s) {unknown}; the template accepts {settable}")
    for key in INTEGER_FIELDS:
        if key in extra:
            value = extra[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ScaffoldError(f"{key} must be a positive integer, got {value!r}")
    package = extra.get("package_name")
    if package is not None and not str(package).isidentifier():
        raise ScaffoldError(f"package_name {package!r} is not a valid Python package name")

    output_dir = Path(output_dir)
    context = {"modality": modality, **{k: str(v) for k, v in extra.items()}}
    output_dir.mkdir(parents=True, exist_ok=True)
    # A private cookiecutter config: the user's ~/.cookiecutterrc cannot change the defaults, and the
    # replay file cookiecutter always writes lands in a temporary directory instead of the home directory.
    with tempfile.TemporaryDirectory(prefix="stitch-scaffold-") as scratch:
        config = Path(scratch) / "cookiecutter.yaml"
        config.write_text(
            f"replay_dir: {json.dumps(str(Path(scratch) / 'replay'))}\n"
            f"cookiecutters_dir: {json.dumps(str(Path(scratch) / 'cookiecutters'))}\n"
        )
        try:
            project = cookiecutter(
                str(template),
                no_input=True,
                extra_context=context,
                output_dir=str(output_dir),
                config_file=str(config),
                overwrite_if_exists=False,
            )
        except OutputDirExistsException as exc:
            where = str(exc).removeprefix("Error: ")
            raise ScaffoldError(f"{where}; choose another output directory or remove it") from exc
        except CookiecutterException as exc:
            raise ScaffoldError(f"rendering the {TEMPLATE_NAME!r} template failed: {exc}") from exc
    return Path(project)
