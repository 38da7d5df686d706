"""The ``stitch`` command line's Typer app and its consoles; commands live in the sibling modules."""

from __future__ import annotations

import os

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="stitch: attach a frozen encoder to a base LM through a projector, and post-train it.")
# Error and table lines stay whole when output is a file or a pipe (CI logs): no hard wrap at 80 columns.
console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)


@app.callback()
def _options(debug: bool = typer.Option(False, "--debug", help="Show the traceback of an error too "
                                                                "(same as STITCH_DEBUG=1).")) -> None:
    """stitch: attach a frozen encoder to a base LM through a projector, and post-train it."""
    if debug:
        os.environ["STITCH_DEBUG"] = "1"  # read by the error boundary (stitch.cli.errors)
