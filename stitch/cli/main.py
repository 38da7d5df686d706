"""The console entry point: every command module registers on the one Typer app."""

from __future__ import annotations

# each command module registers its commands on the app when imported (named by module: no edge back to stitch.cli)
import stitch.cli.recipe  # noqa: F401
import stitch.cli.registry  # noqa: F401
import stitch.cli.scaffold  # noqa: F401
import stitch.cli.serve  # noqa: F401
import stitch.cli.snapshot  # noqa: F401
import stitch.cli.stages  # noqa: F401
from stitch.cli.app import app
from stitch.cli.errors import run_guarded
from stitch.runs.progress import quiet_library_bars


def main() -> None:
    """Console entry point: a user-facing error prints one line and exits with its class's code (docs/errors.md);
    ``stitch --debug`` (or STITCH_DEBUG=1) adds the traceback."""
    quiet_library_bars()  # before transformers loads: a log file gets no \r bars from it either
    run_guarded(app)
