"""Refuse values that would render a broken plugin, before any file is written."""

import re
import sys

MODALITY = "{{ cookiecutter.modality }}"
PACKAGE = "{{ cookiecutter.package_name }}"
NUMBERS = {"tokens_per_item": "{{ cookiecutter.tokens_per_item }}", "feature_width": "{{ cookiecutter.feature_width }}"}

errors = []
if not re.fullmatch(r"[a-z][a-z0-9_]{0,31}", MODALITY):
    errors.append(
        f"modality {MODALITY!r} must be a lowercase slug: a letter, then letters, digits or '_' "
        "(at most 32 characters), e.g. 'spectrum' or 'time_series'"
    )
if not PACKAGE.isidentifier():
    errors.append(f"package_name {PACKAGE!r} is not a valid Python package name")
for key, raw in NUMBERS.items():
    if not raw.isdigit() or int(raw) < 1:
        errors.append(f"{key} must be a positive integer, got {raw!r}")
if errors:
    sys.exit("stitch-plugin template: " + "; ".join(errors))
