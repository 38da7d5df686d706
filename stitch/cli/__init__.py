"""The ``stitch`` command line (entry point ``stitch.cli:main``)."""

from stitch.cli.main import app, main

__all__ = ["app", "main"]
