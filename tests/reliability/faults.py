"""A ``python -m stitch`` launcher that SIGKILLs itself at a chosen point, for the fault-injection tests:

    python -m tests.reliability.faults step:5 train sft --recipe R --out RUN   # half of step 5's metrics line written
    python -m tests.reliability.faults write:4 train sft ...                   # half of step 4's rng.pt written
    python -m tests.reliability.faults summary:alignment run R --out RUN       # after alignment's summary.json

The kill comes from inside the process at an exact point, so a test needs no timing; the library is patched
here, in the test's launcher, and holds no switch of its own."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

import stitch.runs.checkpoint as checkpoint
import stitch.runs.metrics as metrics
import stitch.stages.loop as loop
from stitch.cli import main


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_mid_metrics_line(step: int) -> None:
    """Write the first half of step ``step``'s metrics line (no newline), then die: a torn last line."""
    write = metrics.MetricsLog.write

    def torn(self: metrics.MetricsLog, record: dict) -> None:
        if record.get("step") == step and not record.get("final"):
            line = metrics.json.dumps(record)
            with self.path.open("a") as fh:
                fh.write(line[: len(line) // 2])
            _die()
        write(self, record)

    metrics.MetricsLog.write = torn


def kill_mid_checkpoint_write(step: int) -> None:
    """Write half of step ``step``'s ``rng.pt`` into its temp dir, then die: a partial ``.step_N.XXXX/``."""
    save = torch.save

    def partial(obj: object, path: object, *args: object, **kwargs: object) -> None:
        target = Path(str(path))
        if target.name == "rng.pt" and target.parent.name.startswith(f".step_{step}."):
            save(obj, target, *args, **kwargs)
            data = target.read_bytes()
            target.write_bytes(data[: len(data) // 2])
            _die()
        save(obj, path, *args, **kwargs)

    checkpoint.torch.save = partial  # the module's name for torch: torch.save for every caller


def kill_after_summary(stage: str) -> None:
    """Die right after ``stage`` wrote its summary.json (``stitch run`` between two stages)."""
    write = loop.write_text_atomic

    def then_die(path: Path, text: str) -> None:
        write(path, text)
        if Path(path).name == "summary.json" and Path(path).parent.name == stage:
            _die()

    loop.write_text_atomic = then_die


FAULTS = {"step": lambda arg: kill_mid_metrics_line(int(arg)), "write": lambda arg: kill_mid_checkpoint_write(int(arg)),
          "summary": kill_after_summary}

if __name__ == "__main__":
    kind, _, arg = sys.argv[1].partition(":")
    FAULTS[kind](arg)
    sys.argv = ["stitch", *sys.argv[2:]]
    main()
