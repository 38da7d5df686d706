"""The console entry point: every command module registers on the one Typer app."""

from __future__ import annotations

import os
import sys

from rich.markup import escape

# each command module registers its commands on the app when imported (named by module: no edge back to stitch.cli)
import stitch.cli.recipe  # noqa: F401
import stitch.cli.registry  # noqa: F401
import stitch.cli.scaffold  # noqa: F401
import stitch.cli.serve  # noqa: F401
import stitch.cli.snapshot  # noqa: F401
import stitch.cli.stages  # noqa: F401
from stitch.cli.app import app, err_console
from stitch.host.host import PluginError, RegistryLookupError
from stitch.runs.lock import RunLockedError
from stitch.runs.progress import quiet_library_bars


def main() -> None:
    """Console entry point: a user-facing error prints one clear line (STITCH_DEBUG=1 shows the traceback)."""
    quiet_library_bars()  # before transformers loads: a log file gets no \r bars from it either
    try:
        app()
    except (ValueError, FileNotFoundError, FileExistsError, PluginError, RegistryLookupError, RunLockedError) as exc:
        if os.environ.get("STITCH_DEBUG"):
            raise

        # escaped: a message holding "[...]" (a field path, a list) must print as written, not as markup
        err_console.print(f"[bold red]error:[/bold red] {escape(str(exc))}", highlight=False)
        sys.exit(2)

