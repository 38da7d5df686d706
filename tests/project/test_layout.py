"""The package layout: stitch's internal import graph (imports inside functions included) has no circles."""

from __future__ import annotations

import ast
from pathlib import Path

import stitch

ROOT = Path(stitch.__file__).parent


def _modules() -> dict[str, Path]:
    """Every module of the ``stitch`` package by dotted name (a package by its ``__init__``)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ["stitch", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The stitch modules ``name`` imports anywhere in its body: ``from x import y`` is ``x.y`` when y is a
    submodule, else ``x``; relative imports are resolved against the module's package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_cycle_finder_reports_a_planted_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_stitch_imports_have_no_circles():
    graph = import_graph()
    assert len(graph) > 30 and "stitch.stages.loop" in graph["stitch.stages.supervised"]  # the walk sees edges
    assert "stitch.stages.evaluation" in graph["stitch.stages.loop"]  # ... including imports inside functions
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


# setup (seed, optimizer, scheduler), resume, progress, log, clip, save, summary
SKELETON = ("seed_all(", "AdamW", "LambdaLR", "load_step_state", "latest_step_dir", "progress(", "MetricsLog",
            "clip_grad_norm", "save_step", "write_text_atomic", "layout.summary(")


def test_stage_skeleton_exists_once_in_the_loop():
    """No stage module sets up, resumes, logs, saves or summarises on its own: only stitch.stages.loop does."""
    from stitch.stages.registry import STAGES

    modules = {entry.runner.partition(":")[0] for entry in STAGES.values()}
    loop_text = (ROOT / "stages" / "loop.py").read_text()
    assert [name for name in SKELETON if name not in loop_text] == []  # the list names what the loop really does
    for module in sorted(modules):
        text = (ROOT / Path(*module.split(".")[1:])).with_suffix(".py").read_text()
        found = [name for name in SKELETON if name in text]
        assert not found, f"{module} repeats the stage skeleton: {found}"


def test_stage_table_is_the_one_list_of_stages():
    from stitch.config.options import STAGE_OPTIONS
    from stitch.stages.loop import Stage
    from stitch.stages.registry import STAGES

    assert tuple(STAGES) == tuple(STAGE_OPTIONS)
    order = list(STAGES)
    for name, entry in STAGES.items():
        assert issubclass(entry.stage_class(), Stage) and entry.options is STAGE_OPTIONS[name]
        if entry.warm_start is not None:  # a warm start comes from an earlier stage
            assert order.index(entry.warm_start) < order.index(name) and entry.warm_parts
    assert (STAGES["sft"].warm_start, STAGES["grpo"].warm_start, STAGES["dpo"].warm_start) == ("alignment", "sft", "sft")
