"""A generated video dataset: one ball moving left, right, up or down per clip, written as real MP4 files with PyAV
(``stitch-clip[video]``), and a JSON-lines table of rows asking which way it moves."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

from stitch_clip.video import require_av

DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
QUESTION = "Which way does the ball move? Answer left, right, up or down."
COLORS = ((255, 64, 64), (64, 220, 64), (80, 120, 255), (255, 220, 40), (230, 230, 230))


def write_clip(path: Path, direction: str, rng: random.Random, size: int = 64, frames: int = 8, fps: int = 8) -> None:
    """An MP4 (MPEG-4 part 2, yuv420p) of ``frames`` frames at ``fps``: a ball starting near the centre and moving
    about two fifths of the frame towards ``direction``, on a dark background."""
    av = require_av()
    dx, dy = DIRECTIONS[direction]
    radius = size // 9
    travel = size * 2 // 5
    x0 = size / 2 + rng.uniform(-size / 16, size / 16)
    y0 = size / 2 + rng.uniform(-size / 16, size / 16)
    color = np.array(rng.choice(COLORS), dtype=np.uint8)
    yy, xx = np.mgrid[0:size, 0:size]
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.options = {"qscale": "2"}  # near-lossless: the ball keeps its edge
        for k in range(frames):
            t = k / (frames - 1)
            cx, cy = x0 + dx * travel * t, y0 + dy * travel * t
            image = np.full((size, size, 3), 16, dtype=np.uint8)
            image[(xx - cx) ** 2 + (yy - cy) ** 2 <= radius**2] = color
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def write_dataset(root: Path, rows: int, seed: int = 0, **clip: int) -> Path:
    """``root/clips/NNNNN.mp4`` and ``root/rows.jsonl`` (``id``, ``video`` path relative to ``root``, ``question``,
    ``answer`` "The answer is <direction>.", the demo base's answer form); directions cycle so every run of four
    rows holds each once. Returns the JSON-lines path."""
    rng = random.Random(seed)
    clips = root / "clips"
    clips.mkdir(parents=True, exist_ok=True)
    names = list(DIRECTIONS)
    with open(root / "rows.jsonl", "w", encoding="utf-8") as table:
        for i in range(rows):
            direction = names[i % len(names)]
            write_clip(clips / f"{i:05d}.mp4", direction, rng, **clip)
            table.write(json.dumps({"id": f"clip{i:05d}", "video": f"clips/{i:05d}.mp4", "question": QUESTION,
                                    "answer": f"The answer is {direction}."}) + "\n")
    return root / "rows.jsonl"
