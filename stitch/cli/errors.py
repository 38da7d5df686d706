"""The command line's one error boundary: every command's user-facing failure becomes one line and an exit code
per class (docs/errors.md); anything else is an internal error, shown with its traceback and said to be one.

    2  input     a recipe, a path, a column, a row, a partition the data cannot fill, a binary file, a changed run
    3  artifact  a checkpoint, feature cache, projector or adapter that differs from what was written
    4  resource  a full disk, a run directory another process holds, memory
    1  internal  a bug in stitch (traceback printed)
"""

from __future__ import annotations

import errno
import os
import sys
import traceback
from dataclasses import dataclass

from rich.markup import escape

from stitch.cli.app import err_console

DEBUG_ENV = "STITCH_DEBUG"  # set by ``stitch --debug``: user-facing errors keep their traceback too


@dataclass(frozen=True)
class ErrorClass:
    code: int
    name: str
    types: tuple[str, ...]  # "module:Class"

    def loaded_types(self) -> tuple[type[BaseException], ...]:
        """The types whose modules this process imported: one it never imported cannot have been raised, so
        classifying an error imports nothing (a refusal made before torch, transformers or datasets loaded stays
        as quick as it was)."""
        pairs = (t.split(":") for t in self.types)
        return tuple(getattr(sys.modules[module], name) for module, name in pairs if module in sys.modules)


# the first class an error is an instance of wins: integrity before input (its errors are ValueErrors too)
ERROR_CLASSES = (
    ErrorClass(4, "resource", ("stitch.runs.diskspace:DiskFullError", "stitch.runs.lock:RunLockedError",
                               "builtins:MemoryError", "torch:OutOfMemoryError")),
    ErrorClass(3, "artifact", ("stitch.runs.checkpoint:CheckpointIntegrityError",
                               "stitch.data.feature_cache:FeatureCacheError", "stitch.model.artifacts:ArtifactError",
                               "stitch.model.loading:SnapshotError")),
    ErrorClass(2, "input", ("builtins:ValueError", "stitch.data.rows:PrepareError", "builtins:OSError",
                            "stitch.host.host:PluginError", "stitch.host.host:RegistryLookupError")),
)
INTERNAL_CODE = 1


def classify(exc: BaseException) -> ErrorClass | None:
    """The class of a user-facing error (an ``ENOSPC`` that no writer named still counts as a full disk), None for
    an internal one."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ERROR_CLASSES[0]
    return next((c for c in ERROR_CLASSES if isinstance(exc, c.loaded_types())), None)


def one_line(exc: BaseException) -> str:
    """The error as one line: its message with line breaks folded (a KeyError's quotes dropped)."""
    text = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    if isinstance(exc, OSError) and exc.filename and str(exc.filename) not in text:
        text = f"{text}: {exc.filename}"
    return " ".join(str(text).split()) or type(exc).__name__


def report(exc: BaseException) -> int:
    """Print ``exc`` the boundary's way and return the exit code."""
    kind = classify(exc)
    if kind is None:
        traceback.print_exception(exc)
        err_console.print(f"[bold red]internal error[/bold red] (a bug in stitch, not in your input): "
                          f"{escape(type(exc).__name__)}: {escape(one_line(exc))}; the traceback above locates it",
                          highlight=False)
        return INTERNAL_CODE
    if os.environ.get(DEBUG_ENV):
        traceback.print_exception(exc)
    # escaped: a message holding "[...]" (a field path, a list) must print as written, not as markup
    err_console.print(f"[bold red]error:[/bold red] {escape(one_line(exc))}", highlight=False)
    return kind.code


def run_guarded(app: object) -> None:
    """Run the Typer ``app``; a failure leaves through ``report`` with its class's exit code."""
    try:
        app()  # type: ignore[operator]  # usage errors and typer.Exit leave as SystemExit, with click's codes
    except Exception as exc:  # noqa: BLE001 - the boundary: everything is reported, nothing escapes raw
        sys.exit(report(exc))
