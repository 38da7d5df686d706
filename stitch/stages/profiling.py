"""Where a stage's time goes: ``profile_steps: [first, last]`` runs those optimizer steps under torch.profiler and
writes ``<stage>/profile/``: ``trace.json`` (open it in Perfetto or chrome://tracing) and ``ops.txt`` (operators by
their own device time, or CPU time on a CPU run). summary.json's ``profile`` names both and lists the top operators.

Profiling changes no result (the same steps, weights and RNG), only their speed, so a profiled step's
``tokens_per_s`` is not a figure to quote.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from stitch.runs.atomic import write_text_atomic

log = logging.getLogger("stitch")
TOP_OPS = 15  # operators summary.json lists; ops.txt holds 60


class StepProfiler:
    """Opens torch.profiler before step ``first`` (1-based, as metrics.jsonl counts) and closes it after ``last``."""

    def __init__(self, steps: tuple[int, int], out_dir: Path) -> None:
        self.first, self.last = steps
        self.out_dir = out_dir
        self.profiler: torch.profiler.profile | None = None
        self.result: dict[str, Any] | None = None

    @property
    def device(self) -> bool:
        return torch.cuda.is_available()

    def before(self, step: int) -> None:
        """Called with the step about to run."""
        if step == self.first and self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()

    def after(self, step: int) -> None:
        """Called with the step just run: after ``last``, the files and the summary entry."""
        if self.profiler is None or step != self.last:
            return
        if self.device:
            torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        self.result = self.write(self.profiler)
        self.profiler = None
        log.info("profile of steps %d-%d: %s", self.first, self.last, self.out_dir)

    def write(self, profiler: torch.profiler.profile) -> dict[str, Any]:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / "trace.json"
        partial = trace.with_suffix(".json.partial")
        profiler.export_chrome_trace(str(partial))
        partial.replace(trace)
        key = "self_device_time_total" if self.device else "self_cpu_time_total"
        averages = profiler.key_averages()
        table = self.out_dir / "ops.txt"
        write_text_atomic(table, averages.table(sort_by=key, row_limit=60) + "\n")
        ranked = sorted(averages, key=lambda e: getattr(e, key), reverse=True)
        total = sum(getattr(e, key) for e in averages) or 1.0
        top = [{"op": e.key, "calls": e.count, "self_ms": round(getattr(e, key) / 1e3, 3),
                "share": round(getattr(e, key) / total, 4)} for e in ranked[:TOP_OPS]]
        return {"steps": [self.first, self.last], "clock": "device" if self.device else "cpu",
                "trace": str(trace), "table": str(table), "top": top}
