"""Experiment trackers (a stage's ``report_to``): the records a stage writes to its metrics JSONL, also sent to
TensorBoard, Weights & Biases (offline), MLflow (a local file store) or trackio, each behind one small interface.

Each tracker's package is an optional extra (``pip install 'stitch-lm[tensorboard]'``); a recipe that names one
whose package is missing is refused when the stage starts, before any model loads. Everything is written under
the stage's directory (``<out>/<stage>/trackers/<tracker>``): nothing leaves the machine.

A resumed stage continues its tracker run rather than starting a second one. Steps a killed process logged past
the checkpoint are redone: TensorBoard drops the old ones (``purge_step``); MLflow, W&B and trackio keep appending
to the same run (their stores cannot delete a point), so a reader that takes the last value of a step sees the
redone one.
"""

from __future__ import annotations

import importlib.util
import math
import os
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")
# the module each tracker imports, and the extra that installs it
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}
SKIPPED_KEYS = ("step", "final")
RUN_ID_FILE = "run_id"  # beside a tracker's files: the run a resumed stage continues


class TrackerError(ValueError):
    """A tracker the recipe names that cannot run here (unknown, or its package not installed)."""


class Tracker(Protocol):
    """One experiment tracker: scalar metrics at a step, then closed once."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics record (booleans, text, lists, None and the step itself left out);
    a record's ``final`` evaluation is reported under ``final/<name>``."""
    prefix = "final/" if record.get("final") else ""
    out = {}
    for key, value in record.items():
        if key in SKIPPED_KEYS or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[prefix + key] = float(value)
    return out


def resumed_run_id(log_dir: Path, resume_step: int | None) -> str | None:
    """The run id recorded under ``log_dir`` when a resumed stage continues it; None for a fresh start or a run
    that recorded none (its trackers were added on resume)."""
    path = Path(log_dir) / RUN_ID_FILE
    return path.read_text().strip() if resume_step is not None and path.is_file() else None


def record_run_id(log_dir: Path, run_id: str) -> str:
    """Record ``run_id`` under ``log_dir`` for a later resume; returns it."""
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    (Path(log_dir) / RUN_ID_FILE).write_text(run_id + "\n")
    return run_id


class TensorBoardTracker:
    """Scalars in a TensorBoard event file (``torch.utils.tensorboard``, which needs the tensorboard package).
    A resume purges the events of steps past the checkpoint."""

    def __init__(self, log_dir: Path, run_name: str, config: dict[str, Any], resume_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # optional: needs the tensorboard extra

        purge = None if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge)
        if resume_step is None:
            self.writer.add_text("recipe", f"run {run_name}\n\n" + "\n".join(f"    {k}: {v}"
                                                                             for k, v in config.items()))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run in offline mode (``wandb sync <dir>`` uploads it later, if the user wants)."""

    def __init__(self, log_dir: Path, run_name: str, config: dict[str, Any], resume_step: int | None = None) -> None:
        import wandb  # optional: needs the wandb extra

        run_id = resumed_run_id(log_dir, resume_step) or record_run_id(log_dir, uuid.uuid4().hex[:8])
        self.wandb = wandb
        self.run = wandb.init(mode="offline", dir=str(log_dir), project="stitch", name=run_name, config=config,
                              id=run_id, resume="allow", reinit="create_new",
                              settings=wandb.Settings(silent=True, console="off"))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()
        # finish() returns before wandb's service has written the run file's last records; teardown waits for it
        self.wandb.teardown()


class MlflowTracker:
    """An MLflow run in a local file store (``mlflow ui --backend-store-uri <dir>`` shows it)."""

    def __init__(self, log_dir: Path, run_name: str, config: dict[str, Any], resume_step: int | None = None) -> None:
        from mlflow.entities import RunStatus  # optional: needs the mlflow extra
        from mlflow.tracking import MlflowClient  # optional: needs the mlflow extra

        # MLflow 3 refuses its file store (maintenance mode) unless this opts in; a user's explicit value stands
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        log_dir.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=log_dir.resolve().as_uri())
        experiment = self.client.get_experiment_by_name("stitch")
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment("stitch")
        known = resumed_run_id(log_dir, resume_step)
        if known is not None:
            self.run_id = known
            self.client.update_run(known, status=RunStatus.to_string(RunStatus.RUNNING))
            return
        self.run_id = record_run_id(log_dir, self.client.create_run(experiment_id, run_name=run_name).info.run_id)
        for key, value in config.items():
            self.client.log_param(self.run_id, key, str(value)[:500])

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric  # optional: needs the mlflow extra

        stamp = int(os.times().elapsed * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, stamp, step) for k, v in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class TrackioTracker:
    """A trackio run in its local SQLite store (``<log_dir>/stitch.db``; ``TRACKIO_DIR=<log_dir> trackio show``)."""

    def __init__(self, log_dir: Path, run_name: str, config: dict[str, Any], resume_step: int | None = None) -> None:
        import trackio  # optional: needs the trackio extra
        import trackio.sqlite_storage  # optional: needs the trackio extra
        import trackio.utils  # optional: needs the trackio extra

        log_dir.mkdir(parents=True, exist_ok=True)
        # trackio reads TRACKIO_DIR once, at import, into these module constants; each stage of a process writes
        # under its own directory, so the tracker points them there before the run opens its store
        trackio.utils.TRACKIO_DIR = trackio.sqlite_storage.TRACKIO_DIR = log_dir.resolve()
        self.run = trackio.init(project="stitch", name=run_name, config=config, auto_log_cpu=False,
                                auto_log_gpu=False, resume="never" if resume_step is None else "allow")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


FACTORIES: dict[str, type] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker,
                              "trackio": TrackioTracker}


def check_trackers(names: Iterable[str], where: str = "report_to") -> None:
    """Refuse (one line) a tracker that is unknown or whose package is not installed, before any work starts."""
    for name in names:
        if name not in FACTORIES:
            raise TrackerError(f"{where}: unknown tracker {name!r}; expected one of {', '.join(TRACKERS)}")
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise TrackerError(f"{where}: tracker {name!r} needs the {PACKAGES[name]} package, which is not "
                               f"installed: pip install 'stitch-lm[{name}]'")


class TrackerSet:
    """The trackers of one stage, fed the same records as its metrics JSONL (``MetricsLog`` sinks)."""

    def __init__(self, trackers: dict[str, Tracker]) -> None:
        self.trackers = trackers

    def write(self, record: Mapping[str, Any]) -> None:
        metrics = scalars(record)
        if metrics:
            for tracker in self.trackers.values():
                tracker.log(metrics, int(record["step"]))

    def close(self) -> None:
        for tracker in self.trackers.values():
            tracker.close()
        self.trackers = {}

    def __enter__(self) -> TrackerSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_trackers(names: Iterable[str], root: Path, run_name: str, config: dict[str, Any] | None = None,
                  where: str = "report_to", resume_step: int | None = None) -> TrackerSet:
    """One tracker per name in ``names``, each writing under ``root/<name>``; ``config`` (flat, scalar values)
    is recorded as the run's parameters. ``resume_step``: the checkpoint step a resumed stage continues from (its
    tracker runs continue too)."""
    names = list(dict.fromkeys(names))
    check_trackers(names, where)
    opened: dict[str, Tracker] = {}
    try:
        for name in names:
            opened[name] = FACTORIES[name](Path(root) / name, run_name, dict(config or {}), resume_step)
    except BaseException:
        TrackerSet(opened).close()
        raise
    return TrackerSet(opened)
