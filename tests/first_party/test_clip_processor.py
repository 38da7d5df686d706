"""The CLIP plugin names transformers' image processor class itself: loading a snapshot's preprocessing prints
no torchvision fallback warning on a machine without torchvision (the README's install removes it)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

LOAD = """
import sys
from pathlib import Path
from stitch.api import ModelSource
from stitch_clip.encoder import build_tiny_clip, load_clip_preprocess
out = Path(sys.argv[1])
build_tiny_clip(out, width=64)
geometry = load_clip_preprocess(ModelSource(local_path=str(out)))
print(geometry.shortest_edge, geometry.crop)
"""


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="the fallback needs torchvision absent")
def test_loading_clip_preprocessing_without_torchvision_prints_no_fallback_warning(tmp_path):
    done = subprocess.run([sys.executable, "-c", LOAD, str(tmp_path / "clip")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["224", "(224,", "224)"]  # the processor config was read
    assert "requires torchvision" not in done.stderr, done.stderr
