"""The report of a preparation, ``prepare-report.json``: what a finished run wrote, reused and retained, where its
data came from and where its seconds went; or, when a refusal leaves skipped rows behind, the error and every
skipped row with its reason."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stitch.data.rows import skipped_by_reason
from stitch.runs.atomic import write_text_atomic

__all__ = ["REPORT_NAME", "PrepareReport", "finished_report", "write_refusal"]

REPORT_NAME = "prepare-report.json"


@dataclass
class PrepareReport:
    out_dir: str
    rows: dict[str, int]  # partition -> rows written (under datasets: <dataset> or <dataset>.<partition>)
    rows_scanned: int
    rows_unassigned: int  # valid rows between partitions: neither written nor skipped
    skipped: list[dict[str, Any]]
    skipped_by_reason: dict[str, dict[str, Any]]
    shards_encoded: int
    shards_reused: int
    items_encoded: int  # distinct media items encoded by this run
    peak_transient_bytes: int
    retained_bytes: int
    retained_bytes_per_row: float
    payload_bytes_per_row: float  # the feature tensors alone
    seconds: float
    provenance: dict[str, Any] = field(default_factory=dict)
    # wall seconds of the main process per phase of the whole prepare() call (PhaseClock.PHASES), and the seconds
    # the decode work took, summed over chunks in whichever process ran them (worker seconds overlap each other)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    worker_seconds: dict[str, float] = field(default_factory=dict)
    # seconds of the encode thread, which encodes a shard while the main thread gathers the next (ENCODE_PHASES)
    encode_seconds: dict[str, float] = field(default_factory=dict)
    # chunks of decoded media by how they reached this process: a shared slot mapped once, or a segment of their own
    media_chunks: dict[str, int] = field(default_factory=dict)
    # media references whose features an earlier row (of any dataset) of this preparation already had: encoded once
    items_shared: int = 0
    # dataset -> {source, rows {partition: n}, rows_scanned, rows_unassigned, skipped, items, items_shared}
    datasets: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def total_rows(self) -> int:
        return sum(self.rows.values())


def write_refusal(out_dir: Path, error: Exception, rows_scanned: int, skipped: list[dict[str, Any]]) -> None:
    """The report of a refused run with skipped rows: the one file the refusal leaves behind."""
    write_text_atomic(out_dir / REPORT_NAME, _json_text({
        "out_dir": str(out_dir), "complete": False, "error": str(error), "rows_scanned": rows_scanned,
        "skipped": skipped, "skipped_by_reason": skipped_by_reason(skipped, first=len(skipped)),
    }))


def finished_report(run: Any, started: float) -> PrepareReport:
    """The report of ``run``, a finished ``stitch.data.prepare`` run that started at ``started``
    (``time.perf_counter``), written to its ``out_dir``: the run's counts as they stand, its provenance and the
    seconds of its phase clock, decode workers (``run.executors``) and encode thread."""
    total_rows = sum(run.rows_written.values())
    retained = run.retained()
    report = PrepareReport(
        out_dir=str(run.out_dir),
        rows=dict(run.rows_written),
        rows_scanned=run.rows_scanned,
        rows_unassigned=sum(ds.rows_unassigned for ds in run.datasets),
        skipped=run.skipped,
        skipped_by_reason=skipped_by_reason(run.skipped, first=len(run.skipped)),
        shards_encoded=run.shards_encoded,
        shards_reused=run.shards_reused,
        items_encoded=run.items_encoded,
        peak_transient_bytes=run.peak_transient,
        retained_bytes=retained,
        retained_bytes_per_row=retained / max(total_rows, 1),
        payload_bytes_per_row=run.items_written * run.item_bytes / max(total_rows, 1),
        seconds=time.perf_counter() - started,
        provenance={**run.provenance, **_dataset_provenance(run), "dtype": run.data.feature_dtype,
                    "recipe": run.recipe.name, "recipe_sha256": run.recipe.digest},
        phase_seconds=run.clock.report(),
        worker_seconds={k: round(v, 4) for k, v in run.executors.decoding.worker_seconds.items()},
        encode_seconds={k: round(v, 4) for k, v in run.encoder.seconds.items()},
        media_chunks=dict(run.executors.decoding.media_chunks),
        items_shared=sum(ds.items_shared for ds in run.datasets),
        datasets={ds.name: ds.report(run.rows_written) for ds in run.datasets},
    )
    write_text_atomic(run.out_dir / REPORT_NAME, _json_text(dataclasses.asdict(report)))
    return report


def _dataset_provenance(run: Any) -> dict[str, Any]:
    """``dataset``: the one source's description, or ``datasets``: each dataset's under ``datasets``."""
    described = {ds.name: ds.data.source.describe() for ds in run.datasets}
    return {"datasets": described} if run.recipe.dataset_options is not None else {"dataset": described["data"]}


def _json_text(payload: Any) -> str:
    return json.dumps(payload, indent=2) + "\n"
