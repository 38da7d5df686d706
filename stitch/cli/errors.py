"""The command line's one error boundary: every command's user-facing failure becomes one line and an exit code
per class (docs/errors.md); anything else is an internal error, shown with its traceback and said to be one.

    2  input     a recipe, a path, a column, a row, a partition the data cannot fill, a binary file, a changed run
    3  artifact  a checkpoint, feature cache, projector or adapter that differs from what was written
    4  resource  a full disk, a run directory another process holds, memory
    1  internal  a bug in stitch (traceback printed)
"""

from __future__ import annotations

import errno
import functools
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
    types: tuple[type[BaseException], ...]


INTERNAL_CODE = 1


@functools.cache
def error_classes() -> tuple[ErrorClass, ...]:
    """The classes in the order they are tried: the first an error is an instance of wins (integrity before input:
    its errors are ValueErrors too)."""
    # imported when an error is classified, not when the CLI starts: these modules bring torch, transformers and
    # datasets, seconds that `stitch --help` and a refusal before any model work should not pay
    import torch

    from stitch.data.feature_cache import FeatureCacheError
    from stitch.data.rows import PrepareError
    from stitch.host.host import PluginError, RegistryLookupError
    from stitch.model.artifacts import ArtifactError
    from stitch.model.loading import SnapshotError
    from stitch.runs.checkpoint import CheckpointIntegrityError
    from stitch.runs.diskspace import DiskFullError
    from stitch.runs.lock import RunLockedError

    return (
        ErrorClass(4, "resource", (DiskFullError, RunLockedError, MemoryError, torch.OutOfMemoryError)),
        ErrorClass(3, "artifact", (CheckpointIntegrityError, FeatureCacheError, ArtifactError, SnapshotError)),
        ErrorClass(2, "input", (ValueError, PrepareError, OSError, PluginError, RegistryLookupError)),
    )


def classify(exc: BaseException) -> ErrorClass | None:
    """The class of a user-facing error (an ``ENOSPC`` that no writer named still counts as a full disk), None for
    an internal one."""
    classes = error_classes()
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return classes[0]
    return next((c for c in classes if isinstance(exc, c.types)), None)


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
