"""CLI tables never cut a name short: on a terminal the cells wrap, in a file or a pipe each row stays whole."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from typing import Any

import typer.main
from rich.console import Console

from stitch.cli.app import print_table, wrapping_table
from stitch.cli.main import app

LONG = "register_rollout_payloads"


def test_list_plugins_piped_at_60_columns_prints_every_hook_name_whole():
    result = subprocess.run([sys.executable, "-m", "stitch", "list-plugins"], capture_output=True, text=True,
                            env={**os.environ, "COLUMNS": "60"}, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "…" not in result.stdout
    for hook in ("register_encoders", "register_rollout_payloads", "register_token_sentinels"):
        assert hook in result.stdout, result.stdout


def test_a_table_on_a_narrow_terminal_wraps_its_cells_instead_of_an_ellipsis():
    screen = io.StringIO()
    out = Console(file=screen, force_terminal=True, width=30, color_system=None)
    table = wrapping_table("plugins", "name", "hooks")
    table.add_row("stitch-clip", LONG)
    print_table(table, out)
    text = screen.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 30
    cells = "".join(line.split("│")[2].strip() for line in text.splitlines() if line.count("│") == 3)
    assert LONG in cells  # the hook name's pieces, read down its column, spell it whole


def test_every_commands_summary_in_stitch_help_is_one_line_of_its_docstring():
    """`stitch --help` lists each command with its docstring's first paragraph, newlines kept: a summary written
    over two lines prints as a broken line there, so it must fit one."""
    def commands(group: Any, prefix: str) -> list[tuple[str, Any]]:
        found = []
        for name, command in group.commands.items():
            found.append((prefix + name, command))
            if hasattr(command, "commands"):  # a group (`stitch recipe`): its subcommands too
                found += commands(command, f"{prefix}{name} ")
        return found

    found = commands(typer.main.get_command(app), "")
    assert len(found) >= 15, [name for name, _ in found]
    for name, command in found:
        summary = (command.help or "").strip().split("\n\n")[0]
        assert summary and "\n" not in summary, f"`stitch {name}`: summary spans lines: {summary!r}"
