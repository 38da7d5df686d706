"""An isolated stitch cache for the test session, so the reference snapshot is built fresh."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def stitch_cache(tmp_path_factory: pytest.TempPathFactory):
    if "STITCH_CACHE" in os.environ:  # CI may share one between runs
        yield os.environ["STITCH_CACHE"]
        return
    os.environ["STITCH_CACHE"] = str(tmp_path_factory.mktemp("stitch-cache"))
    try:
        yield os.environ["STITCH_CACHE"]
    finally:
        os.environ.pop("STITCH_CACHE", None)
