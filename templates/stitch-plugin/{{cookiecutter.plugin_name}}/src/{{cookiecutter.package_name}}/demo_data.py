"""A tiny {{ cookiecutter.modality }} dataset generator, so the shipped recipe runs with no data of your own.

Each row is one 1-D signal stored as a ``.npy`` file: a waveform (sine, square, sawtooth or triangle)
that goes through 1 to 4 cycles, with a random phase, amplitude and a little noise. The question asks how
many cycles; the answer reads "The answer is N." (what the `counting` task rewards and grades). The
template ran this once when the project was rendered, into ``recipes/data/``; to write it again (or
elsewhere, or bigger):

    python -m {{ cookiecutter.package_name }}.demo_data --rows 200

Only numpy: it runs before the plugin is installed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

MODALITY = "{{ cookiecutter.modality }}"
WAVEFORMS = ("sine", "square", "sawtooth", "triangle")
QUESTION = "How many cycles does this signal go through?"
ROWS = 48
DEFAULT_DIR = Path(__file__).resolve().parent / "recipes" / "data"


def waveform(shape: str, cycles: int, length: int, phase: float) -> np.ndarray:
    """``cycles`` periods of ``shape`` over ``length`` samples, starting ``phase`` (in periods) in."""
    t = (np.arange(length) / length * cycles + phase) % 1.0
    if shape == "sine":
        return np.sin(2 * np.pi * t)
    if shape == "square":
        return np.where(t < 0.5, 1.0, -1.0)
    if shape == "sawtooth":
        return 2.0 * t - 1.0
    if shape == "triangle":
        return 1.0 - 4.0 * np.abs(t - 0.5)
    raise ValueError(f"unknown waveform {shape!r}; expected one of {WAVEFORMS}")


def make_rows(rows: int = ROWS, seed: int = 0) -> list[tuple[dict[str, str], np.ndarray]]:
    """``rows`` (record, signal) pairs; the record's media column is the signal's relative ``.npy`` path."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(rows):
        cycles = int(rng.integers(1, 5))
        shape = WAVEFORMS[int(rng.integers(len(WAVEFORMS)))]
        signal = rng.uniform(0.5, 2.0) * waveform(shape, cycles, int(rng.integers(96, 161)), rng.uniform())
        signal = (signal + rng.normal(scale=0.05, size=signal.shape)).astype(np.float32)
        record = {"id": f"s{i:03d}", MODALITY: f"items/s{i:03d}.npy", "question": QUESTION,
                  "answer": f"The answer is {cycles}.", "waveform": shape}
        out.append((record, signal))
    return out


def write_dataset(out_dir: Path = DEFAULT_DIR, rows: int = ROWS, seed: int = 0) -> Path:
    """Write ``out_dir/train.jsonl`` and its ``items/*.npy``; returns the jsonl path."""
    out_dir = Path(out_dir)
    (out_dir / "items").mkdir(parents=True, exist_ok=True)
    lines = []
    for record, signal in make_rows(rows, seed):
        np.save(out_dir / record[MODALITY], signal)
        lines.append(json.dumps(record))
    path = out_dir / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_dataset(args.out, args.rows, args.seed))
