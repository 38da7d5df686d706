"""A CPU run skips the GPU tests, so a renamed private attribute breaks one without a red CI (the encoder's
``_copy_stream`` moved into ``CopyAhead`` and its side-stream test failed only on a GPU). Every private name a
GPU-only test reads must still be a name somewhere in the code it tests."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import GPU_WORDS

REPO = Path(__file__).resolve().parents[2]
CODE = [REPO / name for name in ("stitch", "stitch_clip", "stitch_qwen", "stitch_nemotron", "benchmarks")]
PRIVATE = re.compile(r"^_[a-z]\w*$")  # _name, not __dunder__


def names_in(tree: ast.AST) -> set[str]:
    """Every identifier a module defines or reads: names, attributes, functions, classes, arguments."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(node.name)
        elif isinstance(node, ast.arg):
            found.add(node.arg)
        elif isinstance(node, ast.alias):
            found.add((node.asname or node.name).split(".")[-1])
    return found


def walk_resolved(expr: ast.expr, module: dict[str, ast.expr], seen: frozenset[str] = frozenset()) -> Iterator[ast.AST]:
    """``ast.walk`` of ``expr``, walking into the value of each module-level name it reads."""
    for node in ast.walk(expr):
        yield node
        if isinstance(node, ast.Name) and node.id in module and node.id not in seen:
            yield from walk_resolved(module[node.id], module, seen | {node.id})


def guarded_by_a_gpu(decorators: list[ast.expr], module: dict[str, ast.expr]) -> bool:
    """A ``skipif`` whose reason names CUDA, a GPU or nvjpeg (what tests/conftest.py marks ``gpu``); a mark or a
    reason may be a module-level name (``gpu = pytest.mark.skipif(...)``, ``reason=QWEN_SKIP``)."""
    for deco in decorators:
        for call in (d for d in walk_resolved(deco, module) if isinstance(d, ast.Call)):
            if getattr(call.func, "attr", None) != "skipif":
                continue
            reason = next((k.value for k in call.keywords if k.arg == "reason"), None)
            reason = module.get(reason.id, reason) if isinstance(reason, ast.Name) else reason
            if isinstance(reason, ast.Constant) and any(w in str(reason.value) for w in GPU_WORDS):
                return True
    return False


def gpu_tests(tree: ast.Module) -> Iterator[ast.FunctionDef]:
    module = {target.id: node.value for node in tree.body if isinstance(node, ast.Assign)
              for target in node.targets if isinstance(target, ast.Name)}
    whole_module = "pytestmark" in module and guarded_by_a_gpu([module["pytestmark"]], module)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            if whole_module or guarded_by_a_gpu(node.decorator_list, module):
                yield node


def stale_private_names(tests: list[ast.FunctionDef], label: str, live: set[str]) -> list[str]:
    """``label:line test reads ._name`` for each private attribute one of ``tests`` reads that no module of the code
    has."""
    return [f"{label}:{node.lineno} {test.name} reads .{node.attr}" for test in tests for node in ast.walk(test)
            if isinstance(node, ast.Attribute) and PRIVATE.match(node.attr) and node.attr not in live]


def gpu_tests_of(path: Path) -> list[ast.FunctionDef]:
    return list(gpu_tests(ast.parse(path.read_text(), str(path))))


def live_names() -> set[str]:
    return set().union(*(names_in(ast.parse(path.read_text(), str(path)))
                         for root in CODE for path in root.rglob("*.py")))


def test_every_private_name_a_gpu_only_test_reads_is_still_in_the_code():
    live = live_names()
    found = {path: gpu_tests_of(path) for path in sorted((REPO / "tests").rglob("test_*.py"))}
    checked = sum(map(len, found.values()))
    assert checked >= 25  # the GPU test functions are found (28 at the time of writing): the check is not vacuous
    stale = [line for path, tests in found.items()
             for line in stale_private_names(tests, str(path.relative_to(REPO)), live)]
    assert not stale, "GPU-only tests read names the code no longer has:\n" + "\n".join(stale)


def test_a_renamed_private_attribute_in_a_gpu_only_test_is_caught(tmp_path):
    planted = tmp_path / "test_planted.py"
    planted.write_text(
        "import pytest\nimport torch\n\n\n"
        '@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")\n'
        "def test_side_stream(encoder):\n    assert encoder._copy_stream is None\n    assert encoder._copied_ahead\n")
    stale = [line.split(" reads ")[-1] for line in stale_private_names(gpu_tests_of(planted), planted.name, live_names())]
    assert stale == ["._copy_stream"]
