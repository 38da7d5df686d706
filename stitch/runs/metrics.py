"""Per-step metrics of a stage: an append-only JSONL that a resumed run truncates to its checkpoint step."""

from __future__ import annotations

import json
import resource
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from stitch.runs.atomic import write_text_atomic


class MetricsSink(Protocol):
    """Somewhere else each record goes (an experiment tracker, ``stitch.runs.trackers``)."""

    def write(self, record: Mapping[str, Any]) -> None: ...


class MetricsLog:
    """Append-only JSONL of per-step metrics; on resume, lines past the checkpoint step are dropped. Each record
    written also goes to ``sinks``."""

    def __init__(self, path: Path, sinks: Sequence[MetricsSink] = ()) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.sinks = tuple(sinks)

    def truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        # a run that stopped at ``step`` (--max-steps) logged its final evaluation there; the resumed run logs its own
        keep = [line for line in self.path.read_text().splitlines()
                if line and json.loads(line)["step"] <= step and not json.loads(line).get("final")]
        write_text_atomic(self.path, "".join(line + "\n" for line in keep))

    def reset(self) -> None:
        self.path.unlink(missing_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()
        for sink in self.sinks:
            sink.write(record)

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line]


def peak_memory_bytes() -> int:
    """Peak CUDA allocation when a GPU is present, else the process's peak resident set."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
