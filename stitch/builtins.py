"""What the core registers itself: projectors, rollout engines and the demo recipe."""

from __future__ import annotations

from stitch.hookspecs import hookimpl
