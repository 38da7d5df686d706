"""README.md stays true: its facts table and its recipe example are checked against what stitch loads from
this installed plugin, and a mismatch fails naming the README line to change and the value to put there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from stitch.api import load_plugins

PLUGIN = "{{ cookiecutter.plugin_name }}"
README = Path(__file__).resolve().parents[1] / "README.md"
FACTS_START, FACTS_END = "<!-- facts", "<!-- /facts -->"


def readme_facts(lines: list[str]) -> dict[str, tuple[int, str]]:
    """The facts table's rows, ``name -> (line number, value)``, values without backticks."""
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith(FACTS_START))
        end = next(i for i, line in enumerate(lines) if line.startswith(FACTS_END))
    except StopIteration:
        pytest.fail(f"{README}: no facts table between '{FACTS_START} ...' and '{FACTS_END}'")
    facts = {}
    for number in range(start + 2, end + 1):
        cells = [cell.strip() for cell in lines[number - 1].strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0] not in ("fact", "---"):
            facts[cells[0]] = (number, cells[1].replace("`", ""))
    return facts


def registered_facts() -> dict[str, str]:
    """The same facts, read from what this plugin registers once stitch loads it."""
    host = load_plugins()
    labels = {p["entry_point"] for p in host.describe() if p["name"] == PLUGIN}
    mine = {}
    for reg in host.registrations():
        if reg.plugin in labels:
            mine.setdefault(reg.kind, []).append(reg.name)
    assert len(mine.get("encoders", [])) == 1, f"{PLUGIN} should register one encoder, got {mine}"
    encoder = host.get("encoders", mine["encoders"][0])
    recipes = sorted(mine.get("recipes", []))
    return {
        "encoder": encoder.name,
        "modality": encoder.modality,
        "tokens per item": str(encoder.tokens_per_item),
        "feature width": str(encoder.feature_width),
        "served content parts": ", ".join(encoder.content_parts) or "none",
        "demo recipe": ", ".join(recipes),
        "demo rows": ", ".join(str(demo_rows(host.get("recipes", name).path)) for name in recipes),
    }


def demo_rows(recipe_path: str | Path) -> int:
    recipe = yaml.safe_load(Path(recipe_path).read_text())
    data = Path(recipe_path).parent / recipe["data"]["source"]["path"]
    return sum(1 for line in data.read_text().splitlines() if line.strip())


def test_readme_facts_table_matches_the_registered_plugin():
    lines = README.read_text().splitlines()
    facts, actual = readme_facts(lines), registered_facts()
    stale = []
    for name, value in actual.items():
        if name not in facts:
            stale.append(f"README.md: the facts table has no row '| {name} | `{value}` |'")
        elif facts[name][1] != value:
            number, said = facts[name]
            stale.append(f"README.md line {number}: '{name}' reads {said!r}; the plugin has {value!r}: "
                         f"change that line to '| {name} | `{value}` |'")
    assert not stale, "the README is stale:\n" + "\n".join(stale)


def test_readme_recipe_example_names_the_registered_encoder():
    lines = README.read_text().splitlines()
    encoder = registered_facts()["encoder"]
    found = [(n, line) for n, line in enumerate(lines, start=1) if re.match(r"encoder:\s", line)]
    assert found, "README.md: the recipe example has no 'encoder:' line"
    for number, line in found:
        said = line.split(":", 1)[1].split("#", 1)[0].strip()
        assert said == encoder, (f"README.md line {number}: the recipe example names encoder {said!r}; "
                                 f"the plugin registers {encoder!r}: change that line")
