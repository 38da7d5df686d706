"""Per-step metrics of a stage: an append-only JSONL that a resumed run truncates to its checkpoint step."""

from __future__ import annotations

import json
import logging
import resource
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from stitch.runs.atomic import write_text_atomic
from stitch.runs.diskspace import named_when_full

log = logging.getLogger("stitch")


class MetricsLogError(ValueError):
    """A metrics line that is not JSON before the log's last line; the message names the file and the line."""


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
        """Keep the lines up to ``step``. A torn last line (a process killed mid-write, past LATEST) is dropped and
        said so in one log line: the step it belonged to is redone."""
        if not self.path.exists():
            return
        records = self._parse(torn_tail_ok=True)
        # a run that stopped at ``step`` (--max-steps) logged its final evaluation there; the resumed run logs its own
        keep = [r for r in records if r["step"] <= step and not r.get("final")]
        write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in keep))

    def reset(self) -> None:
        self.path.unlink(missing_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record) + "\n"
        with named_when_full(self.path, len(line), f"a metrics line of {self.path.name}"), self.path.open("a") as fh:
            fh.write(line)
            fh.flush()
        for sink in self.sinks:
            sink.write(record)

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return self._parse(torn_tail_ok=False)

    def _parse(self, torn_tail_ok: bool) -> list[dict[str, Any]]:
        text = self.path.read_bytes().decode("utf-8", errors="replace")
        lines = text.split("\n")
        records = []
        for number, line in enumerate(lines, 1):
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                if torn_tail_ok and number == len(lines):  # no newline after it: the write never finished
                    log.warning("%s: dropped its torn last line %d (a killed write past the checkpoint; that step "
                                "is redone)", self.path, number)
                    continue
                raise MetricsLogError(f"{self.path}: line {number} is not a JSON record ({exc}); expected one "
                                      f"object per line") from None
        return records


def peak_memory_bytes() -> int:
    """Peak CUDA allocation when a GPU is present, else the process's peak resident set."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
