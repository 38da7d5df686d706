"""CLI errors stay whole lines when output is a file or a pipe (CI logs): never wrapped, never truncated."""

from __future__ import annotations

import subprocess
import sys


def test_cli_error_with_a_long_path_is_one_unwrapped_line_on_stderr(tmp_path):
    deep = tmp_path.joinpath(*(["a-rather-long-directory-name"] * 6)) / "missing-recipe-file.yaml"
    res = subprocess.run([sys.executable, "-m", "stitch", "train", "sft", "--recipe", str(deep)],
                         capture_output=True, text=True, env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 2
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert str(deep) in lines[0] and "does not exist" in lines[0]
    assert len(lines[0]) > 80
