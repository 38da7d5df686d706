"""The ``stitch`` command line's Typer app and its consoles; commands live in the sibling modules."""

from __future__ import annotations

import os

import typer
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="stitch: attach a frozen encoder to a base LM through a projector, and post-train it.")
# Error and table lines stay whole when output is a file or a pipe (CI logs): no hard wrap at 80 columns.
console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)


def wrapping_table(title: str, *columns: str) -> Table:
    """A table whose cells wrap instead of cutting a name short with an ellipsis, however narrow the terminal
    (print it with ``print_table``)."""
    made = Table(title=title)
    for column in columns:
        made.add_column(column, overflow="fold")
    return made


LOG_TABLE_WIDTH = 160  # widest a table grows in a file or a pipe before its longest cells wrap


def print_table(table: Table, out: Console = console) -> None:
    """On a terminal the cells wrap to its width; in a file or a pipe the table takes the width its cells need,
    up to ``LOG_TABLE_WIDTH`` (then the longest cells wrap), so names stay whole."""
    if out.is_terminal:
        out.print(table)
        return
    natural = Measurement.get(out, out.options.update(width=10_000), table).maximum
    width = out.width
    # print(width=...) is capped at the console's width: widen the console for this table
    out.width = max(width, min(natural, LOG_TABLE_WIDTH))
    try:
        out.print(table)
    finally:
        out.width = width


@app.callback()
def _options(debug: bool = typer.Option(False, "--debug", help="Show the traceback of an error too "
                                                                "(same as STITCH_DEBUG=1).")) -> None:
    """stitch: attach a frozen encoder to a base LM through a projector, and post-train it."""
    if debug:
        os.environ["STITCH_DEBUG"] = "1"  # read by the error boundary (stitch.cli.errors)
    # here, before every command and not for `stitch --help` alone
    from stitch.kernels.cpu_math import settle_cpu_math  # deferred: stitch --help starts without torch

    settle_cpu_math()  # MKL's kernel choices made on one thread, before any command's parallel CPU math
