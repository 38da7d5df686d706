"""The CLI's one error boundary: a user-facing failure of any command is one line on stderr naming the file and an
exit code per class (2 input, 3 artifact, 4 resource, docs/errors.md); `stitch run` reports a data error exactly as
`stitch prepare` does, and neither leaves anything behind; only an internal error (or --debug) shows a traceback."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

from stitch.cli.errors import ERROR_CLASSES
from stitch.config.recipe import BuiltinSource
from stitch.demo.data import builtin_parquet
from tests.stitch_testing import cli, write_recipe

ENOSPC_SHARD = """
import errno, sys
import stitch.data.prepare as prepare
def full(path, features, metadata):
    path.with_name(".tmp-half").write_bytes(b"half")  # a few bytes land before the disk fills
    raise OSError(errno.ENOSPC, "No space left on device")
prepare.write_shard = full
from stitch.cli import main
sys.argv = ["stitch", *sys.argv[1:]]
main()
"""

INTERNAL = """
import sys
import stitch.cli.stages as stages
def broken(recipe, overrides):
    raise KeyError("a bug")
stages._load = broken
from stitch.cli import main
sys.argv = ["stitch", *sys.argv[1:]]
main()
"""


def stitch(*args: str, launcher: str | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", launcher, *args] if launcher else cli(*args)
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def one_line(res: subprocess.CompletedProcess) -> str:
    """The one error line, the last on stderr (progress bars and library warnings may come before it)."""
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert res.stderr.splitlines()[-1] == errors[0], res.stderr[-3000:]
    return errors[0]


def entries(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def test_a_missing_data_path_is_one_line_with_the_same_code_from_run_and_prepare_and_leaves_nothing(tmp_path):
    missing = tmp_path / "gone.parquet"
    recipe = write_recipe(tmp_path / "r.yaml", data__source={"path": str(missing), "format": "parquet"})
    out = tmp_path / "out"
    (out / "notes").mkdir(parents=True)  # what the user had there stays, and only that
    run = stitch("run", str(recipe), "--out", str(out))
    prepare = stitch("prepare", "--recipe", str(recipe), "--out", str(tmp_path / "fresh"))
    assert run.returncode == prepare.returncode == 2
    assert one_line(run) == one_line(prepare).replace(str(tmp_path / "fresh"), str(out / "data"))
    assert str(missing) in one_line(run)
    assert entries(out) == ["notes"] and not (tmp_path / "fresh").exists()


def test_partitions_beyond_the_data_are_refused_in_one_line_leaving_the_run_directory_as_found(tmp_path):
    rows = builtin_parquet(BuiltinSource(builtin="counting-shapes", rows=100, caption_rows=20))
    # a local file of 100 rows; the grpo partition ends at row 120
    recipe = write_recipe(tmp_path / "r.yaml", data__source={"path": str(rows), "format": "parquet"})
    out = tmp_path / "out"
    res = stitch("run", str(recipe), "--out", str(out))
    assert res.returncode == 2
    line = one_line(res)
    assert "found 100 valid rows before the end of the dataset" in line and "need 120" in line
    assert not out.exists()


def test_a_binary_or_duplicate_key_recipe_is_one_line_naming_the_file_and_debug_adds_the_traceback(tmp_path):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xd8\xff\xe0 a jpeg, not a recipe")
    res = stitch("run", str(binary), "--out", str(tmp_path / "out"))
    assert res.returncode == 2 and str(binary) in one_line(res) and "not UTF-8 text" in one_line(res)
    dup = write_recipe(tmp_path / "dup.yaml")
    dup.write_text(dup.read_text() + "name: dup\n")
    res = stitch("train", "sft", "--recipe", str(dup), "--out", str(tmp_path / "out"))
    assert res.returncode == 2 and "key 'name' appears twice" in one_line(res) and str(dup) in one_line(res)
    debug = stitch("--debug", "run", str(binary), "--out", str(tmp_path / "out"))
    assert debug.returncode == 2 and "Traceback" in debug.stderr and "not UTF-8 text" in debug.stderr.splitlines()[-1]
    assert not (tmp_path / "out").exists()


def test_a_latest_holding_garbage_is_an_artifact_error_naming_it(tmp_path):
    checkpoints = tmp_path / "grpo" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "LATEST").write_bytes(b"\xff\x00\x13garbage")
    res = stitch("serve", str(checkpoints), "--port", "0")
    assert res.returncode == 3
    assert f"{checkpoints / 'LATEST'} is not a step name" in one_line(res)


def test_a_full_disk_while_preparing_is_one_line_naming_the_shard_and_leaves_nothing(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml")
    out = tmp_path / "data"
    res = stitch("prepare", "--recipe", str(recipe), "--out", str(out), launcher=ENOSPC_SHARD)
    assert res.returncode == 4
    line = one_line(res)
    assert "No space left for feature shard" in line and str(out / "feature-cache") in line
    assert not out.exists()


def test_an_internal_error_says_it_is_one_with_its_traceback_and_exit_code_1(tmp_path):
    res = stitch("run", "demo", "--out", str(tmp_path / "out"), launcher=INTERNAL)
    assert res.returncode == 1
    assert "Traceback" in res.stderr and "internal error (a bug in stitch" in res.stderr
    assert "KeyError: a bug" in res.stderr.splitlines()[-1]


def test_every_type_the_boundary_names_is_an_exception_class_of_its_module():
    for error_class in ERROR_CLASSES:
        for named in error_class.types:
            module, name = named.split(":")
            assert issubclass(getattr(importlib.import_module(module), name), BaseException), named


REFUSED_RECIPE = """
import sys
from stitch.cli import main
sys.argv = ["stitch", *sys.argv[1:]]
try:
    main()
except SystemExit as exc:
    print("exit", exc.code, "loaded:", *sorted({"transformers", "datasets", "peft"} & set(sys.modules)))
"""


def test_a_missing_recipe_is_refused_in_one_line_before_transformers_or_datasets_load(tmp_path):
    missing = tmp_path / "missing.yaml"
    for args in (["train", "sft", "--recipe", str(missing)], ["run", str(missing)], ["prepare", "--recipe", str(missing)]):
        res = subprocess.run([sys.executable, "-c", REFUSED_RECIPE, *args], capture_output=True, text=True,
                             cwd=tmp_path, timeout=120)
        assert res.stdout.strip() == "exit 2 loaded:", (args, res.stdout, res.stderr[-2000:])
        assert res.stderr.strip().splitlines() == [f"error: recipe file {str(missing)!r} does not exist"]
    assert list(tmp_path.iterdir()) == []
