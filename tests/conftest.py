"""Shared fixtures: an isolated stitch cache per test session (tiny snapshots are built once there)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def stitch_cache(tmp_path_factory: pytest.TempPathFactory):
    """Point ``STITCH_CACHE`` at a session directory unless the caller set one (CI may reuse it)."""
    if "STITCH_CACHE" in os.environ:
        yield os.environ["STITCH_CACHE"]
        return
    path = tmp_path_factory.mktemp("stitch-cache")
    os.environ["STITCH_CACHE"] = str(path)
    try:
        yield str(path)
    finally:
        os.environ.pop("STITCH_CACHE", None)


@pytest.fixture
def host():
    """A freshly loaded PluginHost (installed plugins, env filters applied)."""
    from stitch.plugins import load_plugins

    return load_plugins()
