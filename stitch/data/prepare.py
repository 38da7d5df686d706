"""Preparation: stream each dataset of a recipe in turn, check every row once (its text tokenized as training will
tokenize it, its media confined to its dataset), encode each distinct media item once into content-addressed feature
shards shared by every dataset, and write one manifest and report; a re-run encodes nothing, and a killed run
resumes from the shards it finished."""

from __future__ import annotations

import functools
import itertools
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from stitch.config.data import BuiltinSource, LocalSource
from stitch.config.recipe import Recipe
from stitch.data.dataset_scan import DatasetDecoders, DatasetScan, recipe_section
from stitch.data.feature_cache import (
    CACHE_DIRNAME,
    MANIFEST_NAME,
    TMP_PREFIX,
    FeatureKey,
    ManifestLines,
    encoder_identity,
    shard_digest_path,
    shard_key,
    verified_shard_digest,
    write_shard,
)
from stitch.data.prepare_report import REPORT_NAME, PrepareReport, finished_report, write_refusal
from stitch.data.rows import (
    BudgetExceeded,
    InvalidRow,
    MediaDecoder,
    PendingRow,
    PrepareError,
    PromptCheck,
    RowDecoder,
    ScannedRow,
    describe_skips,
    media_paths,
    open_stream,
    preprocess_for,
    raw_media_stream,
    scan_row,
    skipped_by_reason,
    stream_rows,
    tree_bytes,
)
from stitch.data.sentinels import SentinelIds
from stitch.kernels.prepare_workers import ChunkDecoding, Executors, ObjectsFrozen, PhaseClock, ShardEncoder
from stitch.plugins.specs import EncoderSpec
from stitch.runs.cleanup import leave_as_found
from stitch.runs.diskspace import check_free_space, named_when_full
from stitch.runs.lock import RunLock
from stitch.runs.progress import progress

__all__ = ["BudgetExceeded", "InvalidRow", "PrepareError", "describe_skips", "prepare", "skipped_by_reason"]

# -- the run --------------------------------------------------------------------------------------------


class _Preparation:
    def __init__(
        self, recipe: Recipe, out_dir: Path, spec: EncoderSpec, encoder: Any, device: str, progress: bool,
        prompts: dict[str, PromptCheck], clock: PhaseClock, frozen: ObjectsFrozen,
        builtin: Callable[[BuiltinSource], Path] | None,
    ) -> None:
        # ``data``: the preparation fields every dataset shares (budgets, dtype, batch and shard sizes, workers)
        self.recipe, self.data, self.spec = recipe, recipe.data, spec
        self.out_dir = out_dir
        self.cache_dir = out_dir / CACHE_DIRNAME
        self.device, self.builtin = device, builtin
        self.dtype = getattr(torch, self.data.feature_dtype)
        self.element_bytes = torch.empty((), dtype=self.dtype).element_size()
        self.item_bytes = spec.tokens_per_item * spec.feature_width * self.element_bytes
        # the encoder's preprocessing for worker processes (its processor config; the weights load only to encode)
        self.preprocess = preprocess_for(spec.preprocess(), device, self.data.prepare.decode)
        self.identity = encoder_identity(spec, self.data.feature_dtype, self.preprocess)
        self.provenance = {
            "encoder": spec.name,
            "encoder_id": self.identity["encoder_id"],
            "encoder_revision": self.identity["encoder_revision"],
        }
        self.progress = progress
        self.referenced: dict[str, int] = {}  # shard name -> bytes
        self.manifest_bytes = 0
        self.peak_transient = 0
        self.shards_encoded = self.shards_reused = self.items_encoded = self.items_written = 0
        self.rows_written: dict[str, int] = {p.name: 0 for p in recipe.partitions}
        named = recipe.dataset_options is not None
        self.datasets = [
            DatasetScan(name, index, data, prompts[name],
                        RowDecoder(prompts[name], MediaDecoder(
                            media_paths(data, recipe_section(name, named)), spec.decode_item,
                            self.preprocess)),
                        ManifestLines(spec.tokens_per_item, spec.feature_width, self.data.feature_dtype,
                                      {**self.provenance, "dataset": data.source.describe()}),  # type: ignore[union-attr]
                        named)
            for index, (name, data) in enumerate(recipe.datasets.items())]
        self.decoder = DatasetDecoders(tuple(ds.decoder for ds in self.datasets))
        # content hash -> (shard, index) of every item this run placed in the cache: a later row with the same
        # item (of this dataset or another) points there instead of encoding it again
        self.located: dict[str, tuple[str, int]] = {}
        self.digests: dict[str, str] = {}  # shard name -> sha256, once its file is written or verified
        self.clock = clock
        self.frozen = frozen  # settled at the first shard and when the encoder is loaded
        self.encoder = ShardEncoder(functools.partial(spec.load, spec.source, device, self.dtype), self.encoder_ready,
                                    self.preprocess, device, self.dtype, self.data.encode_batch_size, encoder)
        # shards not yet in the manifest: (name or None when every item was already cached, rows, digest or its
        # future, estimated bytes, each row's (shard, index) per item, dataset)
        self.writes: deque[tuple[str | None, list[PendingRow], Future | str, int, list[list[tuple[str, int]]],
                                 DatasetScan]] = deque()
        self.executors: Executors | None = None  # the decode workers, the writer and encode threads
        self.encode_failed = False  # set by the encode thread: no shard after a failed one is encoded or written
        self._bar = threading.Lock()  # the progress bar advances from both threads

    def encoder_ready(self, encoder: Any) -> None:
        """Once the encoder is loaded: the loader's imports frozen with the rest, and the encoder compiled when
        ``data.prepare.compile`` asks for it."""
        self.frozen.settle()
        rows = sum(p.rows for p in self.recipe.partitions)
        if self.data.prepare.compiles(self.device, rows):
            if not hasattr(encoder, "compile"):
                raise PrepareError(f"data.prepare.compile: {self.data.prepare.compile} needs an encoder with "
                                   f"compile(batch_size); encoder {self.spec.name!r} has none: set it to auto "
                                   f"or never")
            encoder.compile(self.data.encode_batch_size)

    def retained(self) -> int:
        in_flight = sum(w[3] for w in self.writes)  # shards being written, estimated from their item count
        return sum(self.referenced.values()) + self.manifest_bytes + in_flight

    def check_retained(self, extra: int, what: str) -> None:
        budget = self.data.budgets.retained_bytes
        projected = self.retained() + extra
        if projected > budget:
            raise BudgetExceeded(
                f"retained bytes would reach {projected / 2**20:.1f} MiB {what}, over "
                f"data.budgets.retained_mib={self.data.budgets.retained_mib}; raise the budget, shrink the "
                f"partitions, or pick a smaller data.feature_dtype"
            )

    def check_transient(self, tmp: Path) -> None:
        self.peak_transient = max(self.peak_transient, tree_bytes(tmp))
        if self.peak_transient > self.data.budgets.transient_bytes:
            raise BudgetExceeded(
                f"the temporary datasets cache reached {self.peak_transient / 2**20:.1f} MiB, over "
                f"data.budgets.transient_mib={self.data.budgets.transient_mib}; raise the budget or lower "
                f"data.scan_cap"
            )

    # -- scanning --------------------------------------------------------------------------------------
    @property
    def skipped(self) -> list[dict[str, Any]]:
        return [row for ds in self.datasets for row in ds.skipped]

    @property
    def rows_scanned(self) -> int:
        return sum(ds.rows_scanned for ds in self.datasets)

    def scanned_rows(self, ds: DatasetScan, stream: Iterable[Mapping[str, Any]]) -> Iterator[ScannedRow]:
        """Rows of ``ds`` in stream order with their text checked; an error is kept with its row, raised when the
        run reaches it (rows read ahead for the decode workers must not change what is reported, or when). Under
        ``datasets`` a row id is ``<dataset>:<id>``: ids stay unique in the one manifest."""
        rows = iter(itertools.islice(stream_rows(stream), ds.data.scan_cap))
        for position in itertools.count():
            with self.clock("scan"):  # reading the stream and checking the row's text
                raw = next(rows, None)
                if raw is None:
                    return
                row = scan_row(raw, ds.data.columns, position,  # type: ignore[arg-type]
                               ds.prompts.sentinels.marker)
                if ds.named:
                    row.id = f"{ds.name}:{row.id}"
            yield row

    def decoded_rows(self, ds: DatasetScan, rows: Iterator[ScannedRow],
                     decoding: ChunkDecoding) -> Iterator[tuple[ScannedRow, Any, Any]]:
        """Each scanned row with its token counts (``PromptCheck.measure``) and media result (``(hashes, items)``
        or ``(kind, reason)``; None when its conversation does not tokenize), both None after a text error, in
        stream order; ``decoding`` runs the decoder on chunks of rows ahead of the one the run is at."""
        def job(row: ScannedRow) -> tuple[Any, ...] | None:
            return None if row.error else (ds.index, row.id, row.messages, row.extra, row.values)

        for chunk, measured, results in decoding.answers(rows, job, self.decoder.rows):
            for row in chunk:
                yield (row, None, None) if row.error else (row, next(measured), next(results))

    def valid_rows(self, ds: DatasetScan, stream: Iterable[Mapping[str, Any]],
                   decoding: ChunkDecoding) -> Iterator[PendingRow]:
        """Selected rows of ``ds`` in stream order; invalid rows are raised or skipped, never given an ordinal."""
        data = ds.data
        ordinal, needed = 0, data.rows_needed  # a property over the partitions: read once, not per row
        for row, measured, media in self.decoded_rows(ds, self.scanned_rows(ds, stream), decoding):
            ds.rows_scanned = row.position + 1
            partition = data.partition_of(ordinal)  # the one this row takes if it is valid
            try:
                if row.error is not None:
                    raise row.error
                # the prompt is judged before the media, whichever failed first in the worker
                ds.prompts.budgets_check(measured, partition and partition.name, row.id, row.position)
                if isinstance(media[0], str):
                    kind, reason = media
                    raise InvalidRow(row.id, row.position, data.columns.media, reason, kind)  # type: ignore[union-attr]
            except InvalidRow as bad:
                if data.on_corrupt == "error":
                    raise PrepareError(
                        f"{ds.where}{bad}. Fix the row, or set {ds.section}.on_corrupt: skip to count and skip such rows"
                    ) from bad
                ds.skipped.append({**bad.as_json(), **({"dataset": ds.name} if ds.named else {})})
                continue
            ordinal += 1
            if partition is not None:
                hashes, items = media
                yield PendingRow(row.id, row.position, partition.name, row.messages, items, hashes, row.extra)
            else:
                ds.rows_unassigned += 1
            if ordinal >= needed:
                break
        if ordinal < needed:
            short = [p.name for p in data.partitions or () if p.end > ordinal]
            cap = f"datasets.{ds.name}.scan_cap" if ds.named else "data.scan_cap"
            limit = (
                f"the scan cap ({cap}={data.scan_cap})"
                if ds.rows_scanned >= (data.scan_cap or 0)
                else "the end of the dataset"
            )
            skips = (f" Skipped by reason: {describe_skips(ds.skipped)}. Every skipped row and its reason: "
                     f"{self.out_dir / REPORT_NAME}." if ds.skipped else "")
            raise PrepareError(
                f"{ds.where}found {ordinal} valid rows before {limit} ({ds.rows_scanned} scanned, "
                f"{len(ds.skipped)} skipped); partitions {short} need {needed}.{skips} Raise {cap}, use a larger "
                f"source, fix the rows, or shrink the partitions"
            )

    # -- shards ----------------------------------------------------------------------------------------
    def shards(self, rows: Iterator[PendingRow]) -> Iterator[list[PendingRow]]:
        """Consecutive rows of one partition, at most ``shard_rows`` each: a new partition starts a shard."""
        pending: list[PendingRow] = []
        for row in rows:
            if pending and (pending[0].partition != row.partition or len(pending) >= self.data.shard_rows):
                yield pending
                pending = []
            pending.append(row)
        if pending:
            yield pending

    def flush(self, ds: DatasetScan, rows: list[PendingRow], manifest: Any, bar: Any) -> None:
        """Encode the shard of the rows' items not yet in the cache, unless that shard exists; its file is written
        by the writer thread while the next shard is decoded and encoded, and its rows reach the manifest, in
        order, once the file is in place. An item an earlier row of this run already placed (same content, any
        dataset) is not encoded again: the row points at that place (``items_shared``)."""
        fresh: dict[str, int] = {}  # hash -> index in this shard, in first-use order
        items: list[tuple[str, Any]] = []
        places: list[list[tuple[str | None, int]]] = []  # None: this shard, named once its key is known
        row_ends: set[int] = set()
        for row in rows:
            keys: list[tuple[str | None, int]] = []
            before = len(items)
            for digest, item in zip(row.hashes, row.media, strict=True):
                if digest in self.located:
                    keys.append(self.located[digest])
                elif digest in fresh:
                    keys.append((None, fresh[digest]))
                else:
                    fresh[digest] = len(items)
                    keys.append((None, len(items)))
                    items.append((row.id, item))
                    continue
                ds.items_shared += 1
            ds.items += len(keys)
            if len(items) > before:  # the row's last new item ends here
                row_ends.add(len(items))
            places.append(keys)
        name = shard_key(self.identity, fresh) + ".safetensors" if items else None
        resolved = [[(shard or name, i) for shard, i in keys] for keys in places]
        for digest, index in fresh.items():
            self.located[digest] = (name, index)  # type: ignore[assignment]
        estimate = 0
        if name is None:  # every item of these rows is already in the cache
            digest_or_future: Future | str = ""
            self.advance(bar, len(rows))
        elif (self.cache_dir / name).is_file():
            with self.clock("verify_reused"):
                # a reused shard must still be the file written
                digest_or_future = verified_shard_digest(self.cache_dir / name)
            self.shards_reused += 1
            self.advance(bar, len(rows))
        else:
            self.check_retained(len(items) * self.item_bytes,
                                f"with shard {name} ({rows[0].id}..{rows[-1].id})")
            assert self.executors is not None
            waiting = len(rows) - len(row_ends)  # rows with no new item: done now
            if waiting:
                self.advance(bar, waiting)
            digest_or_future = self.executors.encoding.submit(self.encode_shard, rows, items, row_ends,
                                                              self.cache_dir / name, bar)
            self.shards_encoded += 1
            self.items_encoded += len(items)
            estimate = len(items) * self.item_bytes
        if not isinstance(digest_or_future, Future):
            for row in rows:
                row.media = []  # the decoded items are not needed
        self.writes.append((name, rows, digest_or_future, estimate, resolved, ds))  # type: ignore[arg-type]
        self.record(manifest, keep=1)

    def encode_shard(self, rows: list[PendingRow], items: list[tuple[str, Any]], row_ends: set[int], path: Path,
                     bar: Any) -> Future:
        """On the encode thread: the shard's features, handed to the writer thread; the writer's future. After a
        shard whose encode failed, none is encoded: the main thread raises that failure when it reaches the shard,
        and the shards queued behind it, already submitted, must not land in the cache meanwhile (a resume would
        then reuse more than the run finished in order)."""
        if self.encode_failed:
            raise PrepareError(f"not encoded: an earlier shard's encode failed (rows {rows[0].id}..{rows[-1].id})")
        try:
            features = self.encoder.encode(items, row_ends, (self.spec.tokens_per_item, self.spec.feature_width),
                                           self.check_features, functools.partial(self.advance, bar))
        except BaseException:
            self.encode_failed = True
            raise
        for row in rows:
            row.media = []  # the decoded items are no longer needed (a shared slot is free once its views are gone)
        items.clear()
        assert self.executors is not None
        check_free_space(path, features.nbytes, f"feature shard {path.name}")  # before any byte of it is written
        return self.executors.writer.submit(_write_shard_named, path, features,
                                            {**self.identity, "items": len(features)})

    def advance(self, bar: Any, rows: int) -> None:
        with self._bar:
            bar.update(rows)

    def record(self, manifest: Any, keep: int = 0) -> None:
        """Manifest lines of the written shards, oldest first, leaving ``keep`` shards in flight."""
        while len(self.writes) > keep:
            name, rows, pending, _, places, ds = self.writes[0]
            if isinstance(pending, Future):  # the encode thread's answer: the writer's future
                with self.clock("encode_wait"):
                    pending = pending.result()
            with self.clock("write_wait"):
                digest = pending.result() if isinstance(pending, Future) else pending
            self.writes.popleft()
            with self.clock("manifest"):
                self.record_shard(manifest, name, rows, digest, places, ds)

    def record_shard(self, manifest: Any, name: str | None, rows: list[PendingRow], digest: str,
                     places: list[list[tuple[str, int]]], ds: DatasetScan) -> None:
        """The manifest lines of one written shard's rows (``name`` None: rows whose items were all cached before),
        in order; each item's key names the shard that holds it, this one or an earlier one."""
        if name is not None:
            self.digests[name] = digest
            if name not in self.referenced:  # the shard and its sha256 sidecar are both retained
                path = self.cache_dir / name
                self.referenced[name] = path.stat().st_size + shard_digest_path(path).stat().st_size
        lines = []
        for row, keys in zip(rows, places, strict=True):
            features = [FeatureKey(shard, index, self.digests[shard]) for shard, index in keys]
            lines.append(ds.lines.line(row.id, row.partition, row.messages, features, row.extra))
            self.rows_written[row.partition] += 1
            self.items_written += len(keys)
        text = "".join(lines)
        manifest.write(text)
        self.manifest_bytes += len(text.encode())
        self.check_retained(0, f"after shard {name}" if name else f"after rows {rows[0].id}..{rows[-1].id}")

    def check_features(self, features: torch.Tensor, batch: list[tuple[str, Any]]) -> None:
        expected = (len(batch), self.spec.tokens_per_item, self.spec.feature_width)
        if tuple(features.shape) != expected:
            raise PrepareError(
                f"encoder {self.spec.name!r} returned features of shape {tuple(features.shape)} for rows "
                f"{batch[0][0]}..{batch[-1][0]}; its spec declares {expected}"
            )

    # -- whole run -------------------------------------------------------------------------------------
    def run(self) -> PrepareReport:
        started = time.perf_counter()
        selected = sum(p.rows for p in self.recipe.partitions)
        self.check_retained(selected * self.item_bytes, f"for {selected} rows of features (before encoding)")
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        # left by a killed run: ours (.tmp-<pid>-<shard>) and safetensors' own (it writes .tmpXXXXXX, then renames)
        for stale in self.cache_dir.glob(".tmp*"):
            stale.unlink(missing_ok=True)
        manifest_path = self.out_dir / MANIFEST_NAME
        manifest_tmp = self.out_dir / f"{TMP_PREFIX}{MANIFEST_NAME}"
        tmp = Path(tempfile.mkdtemp(prefix="stitch-prepare-"))
        with self.clock("startup"):
            # the workers start before any thread of this run (tqdm, the writer, the encoder's loader)
            self.executors = Executors(self.decoder, self.preprocess, self.data.prepare.worker_count,
                                       self.data.shard_rows, self.clock)
            if not any(self.cache_dir.glob("*.safetensors")):  # a fresh run must encode: load while rows decode
                self.encoder.preload()
        try:
            bar_of = progress(selected, "prepare", enabled=self.progress, unit="row", leave=False)
            with open(manifest_tmp, "w", encoding="utf-8") as manifest, bar_of as bar:
                for ds in self.datasets:  # in recipe order: which row is first to carry an item is deterministic
                    with self.clock("stream_open"):
                        stream = open_stream(ds.data.source, tmp / "datasets", self.builtin)  # type: ignore[arg-type]
                        stream = raw_media_stream(stream, ds.data.columns.media)  # type: ignore[union-attr]
                    for shard_rows in self.shards(self.valid_rows(ds, stream, self.executors.decoding)):
                        if not self.shards_encoded + self.shards_reused:
                            self.frozen.settle()  # the stream's imports (datasets) frozen, collection back on
                        self.flush(ds, shard_rows, manifest, bar)
                        self.check_transient(tmp)
                        with self._bar:
                            bar.set_postfix(encoded=self.shards_encoded, reused=self.shards_reused, refresh=False)
                self.record(manifest)
            self.check_transient(tmp)
            os.replace(manifest_tmp, manifest_path)
        except PrepareError as exc:  # the report lists every skipped row: the one file a refusal leaves behind
            if not self.skipped:
                raise
            write_refusal(self.out_dir, exc, self.rows_scanned, self.skipped)
            raise
        finally:
            self.executors.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)
            manifest_tmp.unlink(missing_ok=True)
        # orphans: shards of earlier recipes, and the sidecar of a shard whose rename a killed run never made
        for path in [*self.cache_dir.glob("*.safetensors"), *self.cache_dir.glob("*.safetensors.sha256")]:
            if path.name.removesuffix(".sha256") not in self.referenced:
                path.unlink()
        return finished_report(self, started)


def _write_shard_named(path: Path, features: torch.Tensor, metadata: Mapping[str, Any]) -> str:
    """``write_shard``, a full disk named with the shard and its size (its temp file is removed by it)."""
    with named_when_full(path, features.nbytes, f"feature shard {path.name}"):
        return write_shard(path, features, metadata)


def prepare(
    recipe: Recipe,
    out_dir: Path | str,
    *,
    encoder_spec: EncoderSpec,
    tokenizer: Any,
    sentinel_ids: SentinelIds,
    builtin: Callable[[BuiltinSource], Path] | None = None,
    encoder: Any = None,
    device: str = "cpu",
    progress: bool = True,
) -> PrepareReport:
    """Prepare ``recipe``'s data into ``out_dir`` (``feature-cache/`` + ``manifest.jsonl`` + report).

    ``encoder_spec`` is ``recipe.encoder``'s registration; ``tokenizer`` and ``sentinel_ids`` are the recipe's
    model's, which every row's conversation is tokenized with as training will; ``builtin`` materialises a
    builtin source to a parquet path. ``encoder`` is an already-loaded encoder for ``encoder_spec`` (otherwise it
    is loaded on first need). Shards already in the cache are reused; once the new manifest is in place, shards it
    does not reference are deleted. One preparation per ``out_dir`` at a time: a second is refused (``RunLock``).
    """
    datasets = recipe.datasets
    for name, data in datasets.items():
        source = data.source
        if isinstance(source, LocalSource) and not source.path.exists():  # before the encoder or any worker loads
            field = "data.source.path" if recipe.dataset_options is None else f"datasets.{name}.source.path"
            raise PrepareError(f"{field} {str(source.path)!r} does not exist")
    clock = PhaseClock()
    with clock("tokenizer_load"):
        prompts = {name: PromptCheck(recipe, tokenizer, sentinel_ids, encoder_spec.tokens_per_item,
                                     columns=data.columns)  # type: ignore[arg-type]
                   for name, data in datasets.items()}
    out = Path(out_dir)
    # a refusal or failure leaves ``out`` as it was found (the report of skipped rows it points to aside); a killed
    # run's finished shards stay for the next run to reuse
    with leave_as_found(out, keep=(REPORT_NAME,)):
        out.mkdir(parents=True, exist_ok=True)
        with RunLock(out, "prepare"), ObjectsFrozen() as frozen:
            with clock("startup"):
                run = _Preparation(recipe, out, encoder_spec, encoder, device, progress, prompts, clock, frozen,
                                   builtin)
            with named_when_full(out, 0, f"the prepared data in {out}"):  # the manifest and report writes
                return run.run()
