"""Experiment trackers (`report_to`): each writes the records a stage's metrics JSONL gets, read back here from what
the tracker itself wrote (event files, the offline run file, the file store, the SQLite store); a missing package is
refused by name before a stage loads anything."""

from __future__ import annotations

import importlib.util
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from stitch.runs.metrics import MetricsLog
from stitch.runs.trackers import PACKAGES, TrackerError, check_trackers, open_trackers
from tests.stitch_testing import copy_prepared, write_recipe

RECORDS = [
    {"step": 1, "loss": 2.5, "grad_norm": 0.75, "lr_projector": 1e-3, "note": "text", "flag": True, "none": None},
    {"step": 2, "loss": 2.25, "grad_norm": None, "lr_projector": 5e-4, "eval_accuracy": 0.5},
    {"step": 2, "eval_accuracy": 0.625, "final": True},
]
# what each tracker must hold: every finite number of every record, by step (the final evaluation under final/)
EXPECTED = {"loss": {1: 2.5, 2: 2.25}, "grad_norm": {1: 0.75}, "lr_projector": {1: 1e-3, 2: 5e-4},
            "eval_accuracy": {2: 0.5}, "final/eval_accuracy": {2: 0.625}}

needs = {name: pytest.mark.skipif(importlib.util.find_spec(name) is None, reason=f"{name} is not installed "
                                  f"(pip install 'stitch-lm[{name}]')") for name in ("tensorboard", "wandb", "mlflow", "trackio")}


def write_through_metrics_log(tmp_path: Path, tracker: str) -> Path:
    """The records written through a MetricsLog whose sink is the one tracker; returns the tracker's root."""
    root = tmp_path / "trackers"
    with open_trackers([tracker], root, "run-sft", {"lr": 1e-3, "stage": "sft"}) as trackers:
        log = MetricsLog(tmp_path / "metrics.jsonl", sinks=(trackers,))
        for record in RECORDS:
            log.write(record)
    assert log.read() == RECORDS  # the JSONL is unchanged by its sinks
    return root / tracker


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def wandb_records(path: Path) -> list[bytes]:
    """The records of a ``.wandb`` file: LevelDB's log format (32 KiB blocks; each chunk a 7-byte header of
    checksum, little-endian length and type: 1 full, 2 first, 3 middle, 4 last) after a 7-byte ``:W&B`` header."""
    data, block, header = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    records, pending, at = [], b"", header
    while at + header <= len(data):
        if block - at % block < header:  # a block's tail too short for a header is padding
            at += block - at % block
            continue
        length, kind = int.from_bytes(data[at + 4 : at + 6], "little"), data[at + 6]
        chunk = data[at + header : at + header + length]
        at += header + length
        if kind == 0 and length == 0:
            continue
        pending += chunk
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    return records


def wandb_history(run_root: Path) -> dict[str, dict[int, float]]:
    """Every history row of the offline run file (``run-*.wandb``), parsed with wandb's own protobuf schema."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_root.glob("wandb/offline-run-*/run-*.wandb")
    out: dict[str, dict[int, float]] = {}
    for data in wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") != "history":
            continue
        row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        for key, value in row.items():
            if not key.startswith("_"):
                out.setdefault(key, {})[row["_step"]] = value
    return out


def trackio_metrics(store: Path) -> dict[str, dict[int, float]]:
    """Every metrics row of the run in trackio's SQLite store (``stitch.db``), read with the standard library."""
    assert (store / "stitch.db").is_file(), f"trackio wrote no store under {store}"
    with sqlite3.connect(store / "stitch.db") as db:
        (runs,) = db.execute("SELECT COUNT(DISTINCT run_id) FROM metrics").fetchone()
        assert runs == 1, f"{store} holds {runs} runs"
        rows = db.execute("SELECT step, metrics FROM metrics ORDER BY id").fetchall()
    out: dict[str, dict[int, float]] = {}
    for step, metrics in rows:
        for key, value in json.loads(metrics).items():
            out.setdefault(key, {})[step] = value
    return out


def session_starts(loader: Any, log_dir: Path) -> list[list[int]]:
    """Per event file under ``log_dir``, the steps of its session-start (purge) events."""
    return [[e.step for e in loader(str(path)).Load() if e.HasField("session_log")]
            for path in log_dir.glob("events.out.tfevents.*")]


def assert_close(got: dict[str, dict[int, float]], expected: dict[str, dict[int, float]]) -> None:
    assert set(got) == set(expected), f"tracker holds {sorted(got)}"
    for key, by_step in expected.items():
        assert got[key] == pytest.approx(by_step, rel=1e-6), key


@needs["tensorboard"]
def test_tensorboard_event_file_holds_every_scalar_of_every_record_by_step(tmp_path):
    log_dir = write_through_metrics_log(tmp_path, "tensorboard")
    assert_close(tensorboard_scalars(log_dir), EXPECTED)


@needs["wandb"]
def test_wandb_offline_run_file_holds_every_scalar_of_every_record_by_step(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_root = write_through_metrics_log(tmp_path, "wandb")
    assert_close(wandb_history(run_root), EXPECTED)


@needs["mlflow"]
def test_mlflow_file_store_holds_every_scalar_of_every_record_by_step(tmp_path):
    from mlflow.tracking import MlflowClient

    store = write_through_metrics_log(tmp_path, "mlflow")
    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("stitch").experiment_id])
    got = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)} for key in run.data.metrics}
    assert_close(got, EXPECTED)


@needs["trackio"]
def test_trackio_sqlite_store_holds_every_scalar_of_every_record_by_step(tmp_path):
    store = write_through_metrics_log(tmp_path, "trackio")
    assert_close(trackio_metrics(store), EXPECTED)


@needs["trackio"]
def test_trackio_stages_of_one_process_each_write_under_their_own_directory(tmp_path):
    """trackio fixes its directory when first imported; a second stage in the same process (a chain) still writes
    under its own stage directory, not the first one's."""
    first = write_through_metrics_log(tmp_path / "alignment", "trackio")
    second = write_through_metrics_log(tmp_path / "sft", "trackio")
    assert_close(trackio_metrics(first), EXPECTED)
    assert_close(trackio_metrics(second), EXPECTED)


# a process killed after its checkpoint at step 1 had logged steps 2 and 3; the resumed process redoes them
KILLED = [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.25}, {"step": 3, "loss": 2.0}]
REDONE = [{"step": 2, "loss": 1.75}, {"step": 3, "loss": 1.5}]
AFTER_RESUME = {"loss": {1: 2.5, 2: 1.75, 3: 1.5}}


def write_killed_then_resumed(tmp_path: Path, tracker: str) -> Path:
    root = tmp_path / "trackers"
    for records, resume_step in ((KILLED, None), (REDONE, 1)):
        with open_trackers([tracker], root, "run-sft", resume_step=resume_step) as trackers:
            for record in records:
                trackers.write(record)
    return root / tracker


@needs["tensorboard"]
def test_a_resumed_stage_purges_tensorboard_steps_past_its_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    log_dir = write_killed_then_resumed(tmp_path, "tensorboard")
    assert_close(tensorboard_scalars(log_dir), AFTER_RESUME)
    # the resumed process's file tells every reader to drop the killed run's steps from 2 on
    assert sorted(session_starts(EventFileLoader, log_dir)) == [[], [2]]


@needs["mlflow"]
def test_a_resumed_stage_continues_its_mlflow_run_the_redone_steps_logged_last(tmp_path):
    from mlflow.tracking import MlflowClient

    store = write_killed_then_resumed(tmp_path, "mlflow")
    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("stitch").experiment_id])
    history = sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.timestamp)
    assert_close({"loss": {m.step: m.value for m in history}}, AFTER_RESUME)
    assert run.info.status == "FINISHED"


@needs["trackio"]
def test_a_resumed_stage_continues_its_trackio_run_the_redone_steps_logged_last(tmp_path):
    assert_close(trackio_metrics(write_killed_then_resumed(tmp_path, "trackio")), AFTER_RESUME)


@needs["wandb"]
def test_a_resumed_stage_writes_its_wandb_offline_run_under_the_killed_runs_id(tmp_path, monkeypatch):
    from wandb.proto import wandb_internal_pb2

    monkeypatch.setenv("WANDB_SILENT", "true")
    run_root = write_killed_then_resumed(tmp_path, "wandb")
    ids = []
    for path in sorted(run_root.glob("wandb/offline-run-*/run-*.wandb")):
        for data in wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "run":
                ids.append(record.run.run_id)
                break
    assert len(ids) == 2 and ids[0] == ids[1] == (run_root / "run_id").read_text().strip()


def test_a_resume_without_a_recorded_run_id_starts_one_and_records_it(tmp_path):
    from stitch.runs.trackers import record_run_id, resumed_run_id

    assert resumed_run_id(tmp_path / "t", 3) is None  # a run whose trackers were added on resume
    assert record_run_id(tmp_path / "t", "fresh") == "fresh"
    assert resumed_run_id(tmp_path / "t", 5) == "fresh"
    assert resumed_run_id(tmp_path / "t", None) is None  # a fresh start records its own
    assert record_run_id(tmp_path / "t", "new") == "new" and resumed_run_id(tmp_path / "t", 1) == "new"


def test_a_tracker_whose_package_is_missing_is_refused_naming_it_and_the_extra(monkeypatch):
    monkeypatch.setitem(PACKAGES, "wandb", "no_such_package_here")
    with pytest.raises(TrackerError, match=r"stages\.sft\.report_to: tracker 'wandb' needs the no_such_package_here "
                                           r"package.*pip install 'stitch-lm\[wandb\]'"):
        check_trackers(["wandb"], "stages.sft.report_to")


def test_report_to_is_refused_before_any_model_loads_when_a_tracker_is_missing(prepared, tmp_path, monkeypatch):
    import stitch.model.binding
    from stitch.config.recipe import load_recipe
    from stitch.host.host import get_host
    from stitch.stages.loop import run_stage

    monkeypatch.setitem(PACKAGES, "tensorboard", "no_such_package_here")
    monkeypatch.setattr(stitch.model.binding.ModelBinding, "build_model",
                        lambda *a, **k: pytest.fail("a model was built before report_to was checked"))
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", stages__alignment__report_to=["tensorboard"]))
    with pytest.raises(TrackerError, match=r"stages\.alignment\.report_to: tracker 'tensorboard'"):
        run_stage(recipe, "alignment", tmp_path / "run", progress=False, registry=get_host())


def test_unknown_tracker_name_is_refused_by_the_recipe_schema(tmp_path):
    from stitch.config.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=r"stages\.sft\.report_to"):
        load_recipe(write_recipe(tmp_path / "r.yaml", stages__sft__report_to=["comet"]))


@needs["tensorboard"]
def test_a_stage_with_report_to_sends_its_metrics_jsonl_records_to_tensorboard(prepared, tmp_path):
    from stitch.config.recipe import load_recipe
    from stitch.host.host import get_host
    from stitch.stages.loop import run_stage

    copy_prepared(prepared / "run", tmp_path / "run")
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", stages__alignment__report_to=["tensorboard"],
                                      stages__alignment__eval_partition="eval", stages__alignment__eval_rows=2))
    run_stage(recipe, "alignment", tmp_path / "run", progress=False, registry=get_host())
    lines = MetricsLog(tmp_path / "run" / "alignment" / "metrics.jsonl").read()
    expected: dict[str, dict[int, float]] = {}
    for line in lines:
        prefix = "final/" if line.get("final") else ""
        for key, value in line.items():
            if key not in ("step", "final") and isinstance(value, int | float) and not isinstance(value, bool):
                expected.setdefault(prefix + key, {})[line["step"]] = value
    assert {"loss", "lr_projector", "final/eval_accuracy"} <= set(expected)
    assert_close(tensorboard_scalars(tmp_path / "run" / "alignment" / "trackers" / "tensorboard"), expected)


@needs["tensorboard"]
def test_a_stage_resumed_with_report_to_continues_its_tensorboard_run_from_the_checkpoint(prepared, tmp_path):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    from stitch.config.recipe import load_recipe
    from stitch.host.host import get_host
    from stitch.stages.loop import run_stage

    copy_prepared(prepared / "run", tmp_path / "run")
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", stages__alignment__report_to=["tensorboard"],
                                      stages__alignment__save_every=1))
    run_stage(recipe, "alignment", tmp_path / "run", progress=False, registry=get_host(), max_steps=1)
    run_stage(recipe, "alignment", tmp_path / "run", progress=False, registry=get_host(), resume=True)
    log_dir = tmp_path / "run" / "alignment" / "trackers" / "tensorboard"
    assert sorted(session_starts(EventFileLoader, log_dir)) == [[], [2]]
    assert set(tensorboard_scalars(log_dir)["loss"]) == {1, 2}
