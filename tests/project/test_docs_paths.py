"""Every repository path a document names exists: README.md, BENCHMARKS.md, docs/*.md and the plugins' READMEs are
scanned for things that look like paths in this repository (`stitch/...py`, `benchmarks/...`, `tests/...`,
`docs/...`, the plugin packages' files) and a missing one fails, naming the document, the line and the path."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOTS = ("stitch", "stitch_clip", "stitch_qwen", "stitch_nemotron", "benchmarks", "tests", "docs", "plugins",
         "templates", ".ci")
# a path starts at a repository root folder (not inside another word or path), then folder/file characters
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(map(re.escape, ROOTS)) + r")/[\w./{},*-]*[\w}*])")
# written by benchmarks/bench.py (the results folder holds GPU results only, and may be empty in a checkout)
GENERATED = ("benchmarks/results", "benchmarks/RESULTS.md")


def documents() -> list[Path]:
    docs = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "plugins").glob("*/README*.md"))]
    return [d for d in docs if d.exists()]


def expand(path: str) -> list[str]:
    """``stitch/kernels/{graphs,precision}.py`` -> both paths; other text as it is."""
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    return [p for part in match.group(1).split(",") for p in expand(path[:match.start()] + part + path[match.end():])]


def exists(path: str) -> bool:
    path = path.rstrip("/.")
    if path.startswith(GENERATED):
        return True
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


def missing_paths(doc: Path, name: str | None = None) -> list[str]:
    found = []
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        for match in PATH.finditer(line):
            for path in expand(match.group(1)):
                if not exists(path):
                    found.append(f"{name or doc.relative_to(ROOT)}:{number}: {path}")
    return found


def test_the_path_pattern_finds_repository_paths_and_expands_braces():
    line = "see stitch/kernels/{graphs,varlen}.py, benchmarks/bench.py and docs/recipes.md; not mystitch/x.py"
    paths = [p for m in PATH.finditer(line) for p in expand(m.group(1))]
    assert paths == ["stitch/kernels/graphs.py", "stitch/kernels/varlen.py", "benchmarks/bench.py", "docs/recipes.md"]


def test_a_planted_missing_path_is_reported_with_its_document_and_line(tmp_path):
    doc = tmp_path / "planted.md"
    doc.write_text("fine: stitch/api.py and benchmarks/results/sft.json\nbroken: stitch/distributed.py\n")
    assert missing_paths(doc, "planted.md") == ["planted.md:2: stitch/distributed.py"]


def test_every_repository_path_named_in_the_docs_exists():
    missing = [m for doc in documents() for m in missing_paths(doc)]
    assert not missing, "documents name paths that do not exist:\n" + "\n".join(missing)
