"""Preparation: stream a dataset, check every row once, run the frozen encoder once per row, keep features + text.

The feature cache is tokenizer-neutral (the encoder's features do not depend on the LM), but the rows it admits
are not: each row's media values are normalised and confined to the dataset, and its conversation is tokenized
exactly as training will tokenize it, with the recipe's model tokenizer and sentinels, so a row that would
stop training is skipped or refused here, named, before any encoding.

Shards are content-addressed by their inputs (encoder identity, dtype, and the hash of every media item),
written atomically, and looked up before encoding: a re-run encodes nothing, and a killed run resumes
without redoing the shards it finished.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import hashlib
import itertools
import json
import os
import shutil
import tempfile
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from stitch.config.recipe import BuiltinSource, DataSource, HubSource, LocalSource, Recipe
from stitch.data.feature_cache import (
    CACHE_DIRNAME,
    MANIFEST_NAME,
    SHARD_FORMAT,
    SHARD_TENSOR,
    TMP_PREFIX,
    FeatureKey,
    ManifestLines,
    cache_temp_path,
    shard_digest_path,
    verified_shard_digest,
    write_digest,
    write_tensor_file,
)
from stitch.data.shared_slots import SharedSlots, SlotBytes, SlotRef
from stitch.plugins.specs import EncoderSpec
from stitch.runs.atomic import write_text_atomic

REPORT_NAME = "prepare-report.json"
# threads writing shard files: a shard's write overlaps the previous one's, which a new file's page allocation
# bounds (~0.5 s a 154 MB shard on one core); rows still reach the manifest in order
SHARD_WRITERS = 2
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


class PrepareError(RuntimeError):
    """Preparation cannot go on; the message names the row, column, field or budget at fault."""


class BudgetExceeded(PrepareError):
    pass


class InvalidRow(ValueError):
    """A row that cannot be used (corrupt media, empty text, a path outside the dataset, a prompt that does not
    tokenize); ``data.on_corrupt`` decides error or skip. ``kind`` groups rows skipped for the same reason."""

    def __init__(self, row_id: str, position: int, column: str, reason: str, kind: str) -> None:
        super().__init__(f"row {row_id!r} (stream position {position}), column {column!r}: {reason}")
        self.row_id, self.position, self.column, self.reason, self.kind = row_id, position, column, reason, kind

    def as_json(self) -> dict[str, Any]:
        return {"id": self.row_id, "position": self.position, "column": self.column, "kind": self.kind,
                "reason": self.reason}


def skipped_by_reason(skipped: Iterable[Mapping[str, Any]], first: int = 5) -> dict[str, dict[str, Any]]:
    """Skipped rows grouped by ``kind``, most frequent first: ``{kind: {"count", "row_ids"}}`` (the first ``first``
    ids of each)."""
    groups: dict[str, dict[str, Any]] = {}
    for row in skipped:
        group = groups.setdefault(row["kind"], {"count": 0, "row_ids": []})
        group["count"] += 1
        if len(group["row_ids"]) < first:
            group["row_ids"].append(row["id"])
    return dict(sorted(groups.items(), key=lambda kv: -kv[1]["count"]))


def describe_skips(skipped: list[Mapping[str, Any]]) -> str:
    """One clause per skip reason with its count and first row ids, for error lines and the CLI."""
    return "; ".join(f"{kind}: {g['count']} (rows {', '.join(repr(i) for i in g['row_ids'])}"
                     f"{', ...' if g['count'] > len(g['row_ids']) else ''})"
                     for kind, g in skipped_by_reason(skipped).items())


@dataclass
class PrepareReport:
    out_dir: str
    rows: dict[str, int]  # partition -> rows written
    rows_scanned: int
    rows_unassigned: int  # valid rows between partitions: neither written nor skipped
    skipped: list[dict[str, Any]]
    skipped_by_reason: dict[str, dict[str, Any]]
    shards_encoded: int
    shards_reused: int
    items_encoded: int
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
    # how the decode workers' stacked media reached this process, in chunks: written into a shared slot mapped once
    # per run, or as a shared-memory segment of its own (no slot free or none fits, or no item shape declared)
    media_chunks: dict[str, int] = field(default_factory=dict)

    @property
    def total_rows(self) -> int:
        return sum(self.rows.values())


@dataclass
class _PendingRow:
    id: str
    position: int
    partition: str
    messages: list[dict[str, str]]
    media: list[Any]  # decoded items (or the encoder's preprocessed tensors), encoded if the shard is new
    hashes: list[str]
    extra: dict[str, str] = field(default_factory=dict)  # task text columns, e.g. rejected


@dataclass
class _ScannedRow:
    """A row as read from the stream, its text checked; its media are decoded in a worker meanwhile."""

    id: str
    position: int
    error: InvalidRow | PrepareError | None = None  # raised when the run reaches this row, in stream order
    messages: list[dict[str, str]] = field(default_factory=list)
    extra: dict[str, str] = field(default_factory=dict)
    values: list[Any] = field(default_factory=list)


ENCODE_PHASES = {
    "encoder_load": "waiting for the encoder to load (it loads in a thread from the start of a fresh run) and, "
                    "when it compiles, compiling it",
    "inputs": "making each encoder call's input: stacking a batch's items, or the preprocessing's device_batch "
              "(CLIP's: nvjpeg decode and resize on the GPU)",
    "encode": "the encoder (host to device, the tower), features back to the host",
}


class PhaseClock:
    """Where the main process spends a run's wall time: ``with clock(phase)`` adds the time inside to ``phase``;
    a phase entered inside another pauses the outer one, so the phases never count a second twice."""

    PHASES = {
        "tokenizer_load": "loading the tokenizer the prompts are checked with",
        "workers_start": "starting the decode worker processes",
        "stream_open": "opening the dataset stream (datasets resolves the source's files)",
        "startup": "the rest of start-up: the encoder's preprocessing config, the writer and the encoder's loader",
        "scan": "reading rows from the stream and checking their text columns",
        "media_wait": "waiting for workers' tokenized and decoded rows (with 0 workers: doing that work)",
        "encode_wait": "waiting for the encode thread to finish the shard before the one just gathered "
                       "(its own seconds: the report's encode_seconds)",
        "verify_reused": "hashing shards that already exist before reusing them",
        "write_wait": "waiting for the writer thread to finish a shard file",
        "manifest": "manifest lines of written shards",
        "other": "the rest: row bookkeeping, shard keys, the budget checks",
    }

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = defaultdict(float)
        self._open: list[list[Any]] = []  # [phase, since] of the phases entered, innermost last

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        now = time.perf_counter()
        if self._open:
            outer = self._open[-1]
            self.seconds[outer[0]] += now - outer[1]
        self._open.append([phase, now])
        try:
            yield
        finally:
            now = time.perf_counter()
            self.seconds[phase] += now - self._open.pop()[1]
            if self._open:
                self._open[-1][1] = now

    def report(self) -> dict[str, float]:
        total = time.perf_counter() - self.started
        out = {phase: round(self.seconds.get(phase, 0.0), 4) for phase in self.PHASES if phase != "other"}
        out["other"] = round(max(total - sum(self.seconds.values()), 0.0), 4)
        out["total"] = round(total, 4)
        return out


@contextlib.contextmanager
def _one_host_thread() -> Iterator[None]:
    """torch's host copies (stacking a shard's items, features to the feature dtype) on one thread. The decode
    workers keep the other cores busy, and an OpenMP team spinning against them was measured 28x slower than
    one thread (stacking 1,024 images on 2 cores, 1 worker decoding). Copies give the same bytes on any
    number of threads; the encoder itself runs outside this, on the caller's setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# objects in the permanent generation that the program did not freeze: Python 3.12 moves its immortal objects there
# (375 at start-up, 0 before 3.12 and from 3.13); ObjectsFrozen reads a count above this as the program's own freeze
PARKED_BY_PYTHON = gc.get_freeze_count()


class ObjectsFrozen:
    """Python's cyclic collector kept off the objects prepare did not make. A full collection walks every tracked
    object while each thread of the process waits: with torch, transformers and datasets imported (~0.43 M
    objects) one took 0.29 s on the 2-core CPU machine, and prepare's 4,096-image CPU pipeline had one of 0.21 s.

    On entry the objects that exist (the imported libraries, the tokenizer) are frozen (``gc.freeze``) and
    collection is off while the run starts; ``settle`` (the first shard gathered, the encoder loaded) freezes what
    the start-up imported meanwhile (``datasets``, the encoder's modules, torchvision) and turns collection back on,
    so what prepare itself allocates is collected as usual. On exit everything is unfrozen (Python 3.12's own
    parked objects too, which its next collection parks again) and collection is as it was. The worker processes
    fork with the objects frozen: their collections do not touch (and copy) the pages they share with this one.
    Left alone entirely where the program froze objects itself.

    "The program froze objects itself" means more objects frozen than the interpreter keeps there on its own:
    Python 3.12 moves its immortal objects (375 tuples at start-up) into the permanent generation, so a freeze count
    of 0 is no sign of an untouched program. Until this compared against that count (``PARKED_BY_PYTHON``, read at
    import), the H200's Python 3.12 left it inactive, and 16k-image runs there had two full collections of
    0.25-0.44 s, started by allocations of the stream, the encode thread and the process pool's manager thread."""

    def __init__(self) -> None:
        self.active = False
        self.was_enabled = True

    def __enter__(self) -> ObjectsFrozen:
        if gc.get_freeze_count() <= PARKED_BY_PYTHON:
            self.active, self.was_enabled = True, gc.isenabled()
            gc.disable()
            gc.freeze()
        return self

    def settle(self) -> None:
        """The objects made since entry frozen too, and collection on again (where it was on)."""
        if self.active:
            gc.freeze()
            if self.was_enabled:
                gc.enable()

    def __exit__(self, *exc: Any) -> None:
        if self.active:
            self.active = False
            gc.unfreeze()
            if self.was_enabled:
                gc.enable()


def _in_thread(name: str, fn: Any, *args: Any) -> Future:
    """``fn(*args)`` on a thread of its own, named ``name``; the thread ends with its one task."""
    pool = ThreadPoolExecutor(1, thread_name_prefix=name)
    try:
        return pool.submit(fn, *args)
    finally:
        pool.shutdown(wait=False)  # the submitted task still runs


# -- streaming ------------------------------------------------------------------------------------------


def open_stream(source: DataSource, cache_dir: Path) -> Any:
    """A ``datasets`` IterableDataset over the source; every cache it writes goes under ``cache_dir``."""
    from datasets import DownloadConfig, load_dataset

    common: dict[str, Any] = {
        "streaming": True,
        "cache_dir": str(cache_dir),
        "download_config": DownloadConfig(cache_dir=str(cache_dir / "downloads")),
    }
    if isinstance(source, BuiltinSource):
        from stitch.demo.data import ensure_builtin

        parquet = ensure_builtin(source.builtin, source.rows, source.caption_rows, source.seed,
                                 **source.generator_options())
        return load_dataset("parquet", data_files=str(parquet), split="train", **common)
    if isinstance(source, LocalSource):
        if not source.path.exists():
            raise PrepareError(f"data.source.path {str(source.path)!r} does not exist")
        where = {"data_dir": str(source.path)} if source.path.is_dir() else {"data_files": str(source.path)}
        return load_dataset(source.format, split=source.split, **where, **common)
    assert isinstance(source, HubSource)
    return load_dataset(source.hub, source.config, revision=source.revision, split=source.split, **common)


def _raw_media_stream(stream: Any, media_column: str) -> Any:
    """Ask ``datasets`` for undecoded media (``{bytes, path}``) so the encoder's ``decode_item`` decodes it."""
    features = getattr(stream, "features", None)
    feature = features.get(media_column) if features else None
    undecoded = _undecoded(feature) if feature is not None else None
    return stream if undecoded is None else stream.cast_column(media_column, undecoded)


def _undecoded(feature: Any) -> Any:
    """``feature`` (or the media feature a list holds) with decoding off; None when it decodes no media. A ``Json``
    column (what ``datasets`` infers for a column holding a string in some rows and a list in others) is left
    decoding: undecoded it hands back each value's JSON text, so a path would arrive quoted."""
    from datasets import Json

    if isinstance(feature, Json) or not dataclasses.is_dataclass(feature):
        return None
    if getattr(feature, "decode", False):
        return dataclasses.replace(feature, decode=False)
    inner = getattr(feature, "feature", None)
    inner = _undecoded(inner) if inner is not None else None
    return None if inner is None else dataclasses.replace(feature, feature=inner)


STREAM_BATCH_ROWS = 256  # rows read from the stream at a time


def stream_rows(stream: Iterable[Mapping[str, Any]], batch_size: int = STREAM_BATCH_ROWS) -> Iterator[dict[str, Any]]:
    """The stream's rows as dicts, in order. A ``datasets`` stream is read ``batch_size`` rows at a time: row by row
    it formats every row as a table of its own, which took twice the time (15 against 7 us a row on 2 cores) in
    the main process that bounds preparation. Anything else is iterated as it is."""
    batches = getattr(stream, "iter", None)
    if not callable(batches):
        yield from stream
        return
    for batch in batches(batch_size=batch_size):
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns), strict=True):
            yield dict(zip(columns, values, strict=True))


def tree_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


# -- rows -----------------------------------------------------------------------------------------------


def media_fingerprint(value: Any) -> str:
    """sha256 of a raw media value's bytes: bytes, ``{bytes, path}``, a path, or anything with ``tobytes``."""
    digest = hashlib.sha256()
    if isinstance(value, bytes | bytearray | memoryview):
        digest.update(bytes(value))
    elif isinstance(value, Mapping) and value.get("bytes") is not None:
        digest.update(bytes(value["bytes"]))
    elif isinstance(value, Mapping) and value.get("path"):
        digest.update(Path(value["path"]).read_bytes())
    elif isinstance(value, str | os.PathLike):
        digest.update(Path(value).read_bytes())
    elif hasattr(value, "tobytes"):  # PIL images, numpy arrays
        digest.update(repr((getattr(value, "mode", None), getattr(value, "size", None))).encode())
        digest.update(value.tobytes())
    else:
        raise TypeError(f"cannot fingerprint a media value of type {type(value).__name__}")
    return digest.hexdigest()


@dataclass(frozen=True)
class MediaPaths:
    """Where a row's media paths may point. A local source's relative paths resolve against its directory and
    must stay inside it (after ``..`` and symlinks) unless ``data.allow_paths_outside``; a source without a
    directory of its own (hub, builtin) must carry bytes, so a dataset can never make stitch read this
    machine's files."""

    root: Path | None  # the local dataset directory; None: rows must carry bytes
    allow_outside: bool
    source: str  # how errors name the source
    blobs: Path | None = None  # a hub snapshot in the HF cache: its files are symlinks into the repo's blobs/

    def item(self, value: Any) -> Any:
        """One media value normalised for ``decode_item``: bytes, ``{bytes, path}`` with bytes, or a checked path
        (a ``{path}`` dict keeps its other keys); raises ``_BadMedia``."""
        if isinstance(value, bytes | bytearray | memoryview):
            return bytes(value)
        if isinstance(value, Mapping):
            if value.get("bytes") is not None:
                return value  # bytes win; the path is only a name and is never opened
            if value.get("path"):
                return {**value, "path": self.path(str(value["path"]))}
            raise _BadMedia("media-type", f"a media dict needs 'bytes' or 'path', got keys {sorted(value)}")
        if isinstance(value, str | os.PathLike):
            return self.path(os.fspath(value))
        return value  # anything else (a decoded image, an array) is the encoder's decode_item to judge

    def path(self, value: str) -> str:
        if self.root is None:
            raise _BadMedia("path-not-allowed", f"{self.source} rows must carry media bytes; got the path {value!r}, "
                                                f"which would be read from this machine")
        candidate = Path(value) if os.path.isabs(value) else self.root / value
        real = candidate.resolve()
        if not self.allow_outside:
            if not Path(os.path.normpath(candidate)).is_relative_to(self.root):
                how = "an absolute path" if os.path.isabs(value) else "a '..' path"
                raise _BadMedia("path-outside", f"{how} outside the dataset directory {str(self.root)!r}: {value!r}; "
                                                f"set data.allow_paths_outside: true to allow it")
            inside = real.is_relative_to(self.root.resolve()) or (self.blobs and real.is_relative_to(self.blobs))
            if not inside:
                raise _BadMedia("path-outside", f"{value!r} is a symlink to {str(real)!r}, outside the dataset "
                                                f"directory {str(self.root)!r}; set data.allow_paths_outside: true "
                                                f"to allow it")
        if not real.is_file():
            raise _BadMedia("missing-file", f"media file {value!r} not found (looked at {str(candidate)!r})")
        return str(real)


class _BadMedia(ValueError):
    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


def short_value(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def media_paths(data: Any) -> MediaPaths:
    source = data.source
    if isinstance(source, LocalSource):
        root = source.path.parent if source.path.is_file() else source.path  # absolute, symlinks kept
        return MediaPaths(root, data.allow_paths_outside, "local", _snapshot_blobs(source.path))
    return MediaPaths(None, False, "hub" if isinstance(source, HubSource) else "builtin")


def _snapshot_blobs(path: Path) -> Path | None:
    """``REPO/blobs`` when ``path`` lies in a hub snapshot of the HF cache (``REPO/snapshots/REVISION/...``)."""
    path = Path(os.path.abspath(path))  # lexically: the snapshot's own files are symlinks
    for parent in path.parents:
        if parent.parent.name == "snapshots" and parent.parent.parent.name.startswith("datasets--"):
            return (parent.parent.parent / "blobs").resolve()
    return None


def media_items(value: Any, row_id: str, position: int, column: str) -> list[Any]:
    """A media column's value as a list of items: one column may hold one item in some rows and a list in others."""
    values = list(value) if isinstance(value, list | tuple) else [value]
    if not values or any(v is None for v in values):
        raise InvalidRow(row_id, position, column, f"no media value (got {short_value(value)})", "no-media")
    return values


LLAVA_IMAGE_MARKER = "<image>"


def _messages(raw: Mapping[str, Any], recipe: Recipe, row_id: str, position: int) -> list[dict[str, str]]:
    cols = recipe.data.columns
    if cols.messages is None:
        out = []
        for role, column in (("user", cols.question), ("assistant", cols.answer)):
            value = raw[column]
            if isinstance(value, int | float) and not isinstance(value, bool):
                value = str(value)
            if not isinstance(value, str) or not value.strip():
                raise InvalidRow(row_id, position, column, f"expected non-empty text, got {short_value(value)}",
                                 "empty-text")
            out.append({"role": role, "content": value})
        return out
    value = raw[cols.messages]
    if not isinstance(value, list) or not value:
        raise InvalidRow(row_id, position, cols.messages, f"expected a list of chat messages, got "
                                                          f"{short_value(value)}", "bad-messages")
    out = []
    for turn in value:
        role = turn.get("role", turn.get("from")) if isinstance(turn, Mapping) else None
        content = turn.get("content", turn.get("value")) if isinstance(turn, Mapping) else None
        if role not in _ROLES or not isinstance(content, str):
            raise InvalidRow(row_id, position, cols.messages,
                             f"expected {{role, content}} turns (roles {sorted(_ROLES)}), got {short_value(turn)}",
                             "bad-messages")
        # LLaVA-style data marks the image with a literal "<image>" in the text; stitch places media itself
        out.append({"role": _ROLES[role], "content": content.replace(LLAVA_IMAGE_MARKER, "").strip()})
    if out[-1]["role"] != "assistant" or not any(m["role"] == "user" for m in out):
        raise InvalidRow(row_id, position, cols.messages, "messages must contain a user turn and end with the "
                                                          "assistant", "bad-messages")
    return out


def extra_columns(recipe: Recipe) -> dict[str, str]:
    """Text columns kept beside the conversation for the task, as ``ManifestRow.extra`` key -> dataset column
    (``data.columns.rejected``: a dispreferred answer per row, DPO's rejected branch)."""
    column = getattr(recipe.data.columns, "rejected", None)
    return {} if column is None else {"rejected": column}


def _extra(raw: Mapping[str, Any], recipe: Recipe, row_id: str, position: int) -> dict[str, str]:
    out = {}
    for key, column in extra_columns(recipe).items():
        value = raw[column]
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str) or not value.strip():
            raise InvalidRow(row_id, position, column, f"expected non-empty text (data.columns.{key}), got "
                                                       f"{short_value(value)}", "empty-text")
        out[key] = value
    return out


def _row_id(raw: Mapping[str, Any], recipe: Recipe, position: int) -> str:
    column = recipe.data.columns.id
    if column is None:
        return f"row{position}"
    if column not in raw:
        raise _missing_column(column, "id", raw, f"row{position}")
    return str(raw[column])


def _missing_column(column: str, role: str, raw: Mapping[str, Any], row_id: str) -> PrepareError:
    return PrepareError(
        f"row {row_id!r}: column {column!r} (data.columns.{role}) is not in the dataset; "
        f"its columns are: {', '.join(sorted(raw))}"
    )


def _check_columns(raw: Mapping[str, Any], recipe: Recipe, row_id: str) -> None:
    cols = recipe.data.columns
    for role in ("media", "question", "answer", "messages", *extra_columns(recipe)):
        column = getattr(cols, role)
        if column is not None and column not in raw:
            raise _missing_column(column, role, raw, row_id)


class PromptCheck:
    """Tokenizes each row as training will (``tokenize_example`` with the recipe's model tokenizer and sentinels)
    and checks it fits the token budget of every stage that reads its partition. The tokenizer loads once; the
    LM's weights never load here."""

    def __init__(self, recipe: Recipe, host: Any, tokens_per_item: int) -> None:
        from jinja2 import TemplateError

        from stitch.model.binding import ModelBinding

        binding = ModelBinding.for_recipe(recipe, host=host, device="cpu")
        self.model = recipe.model
        self.tokenizer, self.sentinels, self.tokens = binding.tokenizer, binding.sentinel_ids, tokens_per_item
        self.columns = recipe.data.columns
        self.prompt_column = self.columns.messages or self.columns.question  # the column a prompt error names
        self.errors = (ValueError, TemplateError)  # CollatorError is a ValueError; a chat template may raise
        self.budgets: dict[str, list[tuple[str, int]]] = {}  # partition -> (stage, token_budget)
        for stage, opts in recipe.stages.items():
            budget, partition = getattr(opts, "token_budget", None), getattr(opts, "partition", None)
            if budget is not None and partition is not None:
                self.budgets.setdefault(partition, []).append((stage, budget))

    def tokenize(self, conversation: list[dict[str, str]], num_items: int, row_id: str = "?") -> list[int]:
        from stitch.data.collator import tokenize_example

        return tokenize_example(self.tokenizer, conversation, self.sentinels, self.tokens, num_items,
                                row_id=row_id)[0]

    def measure(self, messages: list[dict[str, str]], extra: Mapping[str, str], num_items: int,
                row_id: str) -> list[int | tuple[str, str]]:
        """The token count of each branch (the answer, then DPO's rejected answer), or ``(column, reason)`` for
        the first one that does not tokenize (the branches after it are not tokenized). Independent of the
        row's partition, so a decode worker runs it; ``budgets`` then judges the counts in stream order."""
        branches = [(self.columns.messages or self.columns.answer, messages)]
        if "rejected" in extra:  # DPO tokenizes the rejected answer after the same prompt
            rejected = {"role": "assistant", "content": extra["rejected"]}
            branches.append((self.columns.rejected, [*messages[:-1], rejected]))
        out: list[int | tuple[str, str]] = []
        for answer_column, conversation in branches:
            try:
                out.append(len(self.tokenize(conversation, num_items, row_id)))
            except self.errors as exc:
                column = answer_column if self._answer_at_fault(conversation, num_items) else self.prompt_column
                out.append((column, f"does not tokenize with {self.model!r}'s tokenizer as training would: "
                                    f"{str(exc).removeprefix(f'row {row_id!r}: ')}"))
                break
        return out

    def budgets_check(self, measured: list[int | tuple[str, str]], partition: str | None, row_id: str,
                      position: int) -> None:
        """Raise ``InvalidRow`` for ``measure``'s first failure: a branch that does not tokenize, or one over the
        token budget of a stage that reads ``partition``; branch by branch, as training would meet them."""
        for count in measured:
            if isinstance(count, tuple):
                raise InvalidRow(row_id, position, count[0], count[1], "prompt")
            for stage, budget in self.budgets.get(partition or "", []):
                if count > budget:
                    raise InvalidRow(row_id, position, self.prompt_column,
                                     f"{count} tokens with {self.model!r}'s tokenizer, expected at most "
                                     f"stages.{stage}.token_budget={budget} (stage {stage} reads partition "
                                     f"{partition!r})", "too-long")

    def _answer_at_fault(self, conversation: list[dict[str, str]], num_items: int) -> bool:
        """Whether the same prompt with a plain answer tokenizes (then the answer is what fails)."""
        try:
            self.tokenize([*conversation[:-1], {"role": "assistant", "content": "x"}], num_items)
        except self.errors:
            return False
        return True


# -- media: decoded in worker processes -------------------------------------------------------------------


@dataclass(frozen=True)
class MediaDecoder:
    """One row's raw media values -> (hashes, items): path normalised and confined, fingerprinted, decoded by the
    encoder's ``decode_item`` or turned into a fixed-shape tensor by its ``preprocess``. Picklable: prepare's
    worker processes run it; a bad value comes back as ``(kind, reason)``, never raised across processes."""

    paths: MediaPaths
    decode: Callable[[Any], Any]
    preprocess: Callable[[Any], Any] | None = None

    def row(self, values: list[Any]) -> tuple[list[str], list[Any]] | tuple[str, str]:
        hashes, items = [], []
        for value in values:
            try:
                value = self.paths.item(value)
                items.append(self.preprocess(value) if self.preprocess else self.decode(value))
                hashes.append(media_fingerprint(value))
            except _BadMedia as exc:
                return exc.kind, str(exc)
            except (ValueError, OSError) as exc:
                return "corrupt-media", f"corrupt media ({exc})"
            except TypeError as exc:
                return "media-type", str(exc)
        return hashes, items

    def rows(self, chunk: list[list[Any] | None], slots: SharedSlots | None = None,
             slot: int | None = None) -> tuple[list[Any], torch.Tensor | SlotRef | None]:
        """Each row's result (None for a row given as None); with ``preprocess``, the rows' tensors are stacked
        into one (one shared-memory transfer per chunk; into ``slots``' slot ``slot`` when given and the stack
        fits it) and each good row holds its count instead of its items. A preprocess that does not stack but
        hands over (``hand_over``) puts its items' payloads into the slot instead (``SlotWriter``)."""
        results = [None if values is None else self.row(values) for values in chunk]
        if self.preprocess is None or not getattr(self.preprocess, "stacks", True):
            hand_over = getattr(self.preprocess, "hand_over", None)
            if hand_over is None or slots is None or slot is None:
                return results, None
            writer = slots.writer(slot)
            return _with_items(results, lambda items: hand_over(items, writer.put)), writer.ref()
        tensors = [t for r in results if r is not None and isinstance(r[0], list) for t in r[1]]
        stacked: torch.Tensor | SlotRef | None = None
        if tensors:
            fits = slots is not None and slot is not None and slots.fits(tensors)
            stacked = slots.stack_into(slot, tensors) if fits else torch.stack(tensors)  # type: ignore[union-attr]
        return [(r[0], len(r[1])) if r is not None and isinstance(r[0], list) else r for r in results], stacked


_RowJob = tuple[str, list[dict[str, str]], dict[str, str], list[Any]]  # id, messages, extra, raw media values


@dataclass(frozen=True)
class RowDecoder:
    """What a decode worker does for each row, in the order the run judges it: tokenize its conversation
    (``PromptCheck.measure``), then, unless that failed, normalise, fingerprint and decode its media
    (``MediaDecoder``). Both are per-row work independent of the rows before, so they leave the main process;
    only the token budgets, which depend on the row's partition (its ordinal among valid rows), stay there."""

    prompts: PromptCheck
    media: MediaDecoder

    def rows(self, chunk: list[_RowJob], slots: SharedSlots | None = None,
             slot: int | None = None) -> tuple[list[Any], list[Any], Any, tuple[float, float]]:
        """``(measured, media, stacked, (prompt_s, media_s))``: ``measure``'s answer per row, ``MediaDecoder.rows``'
        answer (None for a row whose conversation does not tokenize) and the seconds each part took."""
        started = time.perf_counter()
        measured = [self.prompts.measure(messages, extra, len(values), row_id)
                    for row_id, messages, extra, values in chunk]
        tokenized = time.perf_counter()
        media, stacked = self.media.rows([None if isinstance(m[-1], tuple) else job[3]
                                          for m, job in zip(measured, chunk, strict=True)], slots, slot)
        return measured, media, stacked, (tokenized - started, time.perf_counter() - tokenized)


_WORKER_DECODER: RowDecoder | None = None
_WORKER_SLOTS: SharedSlots | None = None  # inherited through fork, never pickled


def _init_media_worker(decoder: RowDecoder, slots: SharedSlots | None = None) -> None:
    global _WORKER_DECODER, _WORKER_SLOTS
    with contextlib.suppress(Exception):  # Linux: a killed run takes its workers with it (they would wait forever)
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    torch.set_num_threads(1)  # one decode per process; torch only stacks here
    _WORKER_DECODER, _WORKER_SLOTS = decoder, slots


def _decode_chunk(chunk: list[_RowJob], slot: int | None = None) -> tuple[list[Any], list[Any], Any, tuple[float, float]]:
    assert _WORKER_DECODER is not None
    return _WORKER_DECODER.rows(chunk, _WORKER_SLOTS, slot)


def _unstack(results: list[Any], stacked: torch.Tensor | None) -> list[Any]:
    """``MediaDecoder.rows``' answer back to per-row ``(hashes, items)`` or ``(kind, reason)``."""
    if stacked is None and not any(r is not None and isinstance(r[1], int) for r in results):
        return results
    out, at = [], 0
    for result in results:
        if result is None:
            out.append(None)
            continue
        first, second = result
        if isinstance(first, list):
            out.append((first, list(stacked[at : at + second]) if second else []))
            at += second
        else:
            out.append((first, second))
    return out


def _with_items(results: list[Any], change: Callable[[list[Any]], list[Any]]) -> list[Any]:
    """``MediaDecoder.rows``' per-row answers with each good row's items ``change``d (a worker's ``hand_over``, the
    main process's ``take_over``); rows given as None and bad rows' ``(kind, reason)`` as they are."""
    return [(r[0], change(r[1])) if r is not None and isinstance(r[0], list) else r for r in results]


def _taken_over(results: list[Any], view: Callable[[SlotBytes], Any], preprocess: Any) -> list[Any]:
    """``MediaDecoder.rows``' answer for a chunk whose payloads a worker put into a slot: each row's items with
    every ``SlotBytes`` they name viewed in the slot (``preprocess.take_over``; ``view``: ``take_payloads``)."""
    return _with_items(results, lambda items: preprocess.take_over(items, view))


def fork_available() -> bool:
    import multiprocessing

    return "fork" in multiprocessing.get_all_start_methods()


def media_pool(workers: int, decoder: RowDecoder, slots: SharedSlots | None = None) -> Executor | None:
    """Worker processes for ``decoder``, started now; None for 0 (decode in this process). Forked where the
    platform can (as torch's DataLoader does: the workers never touch CUDA), so starting them costs milliseconds,
    not imports, and they inherit the loaded tokenizer and ``slots`` (only a forked worker can: ``slots`` needs
    ``fork_available()``)."""
    if workers == 0:
        return None
    import torch.multiprocessing as mp  # its pickler hands tensors over in shared memory

    method = "fork" if fork_available() else "spawn"
    if slots is not None and method != "fork":
        raise ValueError("shared slots reach the decode workers only through fork")
    pool = ProcessPoolExecutor(workers, mp_context=mp.get_context(method), initializer=_init_media_worker,
                               initargs=(decoder, slots))
    pool.submit(int)  # a forking pool starts every worker at its first task: now, before the run starts threads
    return pool


MEDIA_CHUNK_ROWS = 64  # rows per worker task: large enough to amortise the hand-over, small enough to pipeline


def shard_chunks(shard_rows: int) -> int:
    """Worker tasks (chunks of ``MEDIA_CHUNK_ROWS``) a shard's rows take."""
    return -(-shard_rows // MEDIA_CHUNK_ROWS)


def chunks_ahead(workers: int, shard_rows: int) -> int:
    """Worker tasks in flight ahead of the row the run is at: a shard's rows, and at least 4 chunks per worker."""
    return max(4 * workers, shard_chunks(shard_rows))


def media_slots(preprocess: Any, workers: int, shard_rows: int) -> SharedSlots | None:
    """Shared slots for forked workers' chunks when ``preprocess`` declares its item shape (a chunk's stack), or
    the room its ``hand_over`` may fill per item (``slot_bytes_per_item``: a chunk's payloads), else None. Enough
    for the chunks in flight, the shard being gathered and the one being encoded (a row's items stay in its
    chunk's slot until the row's shard is encoded); a chunk that finds none free travels as it would without."""
    shape = getattr(preprocess, "item_shape", None)
    hands_over = hasattr(preprocess, "hand_over") and hasattr(preprocess, "take_over")
    per_item = getattr(preprocess, "slot_bytes_per_item", None) if hands_over else None
    if not workers or (shape is None and per_item is None) or not fork_available():
        return None
    count = chunks_ahead(workers, shard_rows) + 2 * shard_chunks(shard_rows) + 2
    try:
        if shape is None:
            return SharedSlots(count, MEDIA_CHUNK_ROWS * int(per_item))
        return SharedSlots.for_items(tuple(shape), getattr(preprocess, "item_dtype", torch.uint8), MEDIA_CHUNK_ROWS,
                                     count)
    except OSError:  # the mapping was refused (a strict overcommit limit): every chunk travels as it would without
        return None


# -- shards ---------------------------------------------------------------------------------------------


def preprocess_for(preprocess: Any, device: str, decode: str) -> Any:
    """The encoder's preprocessing as this run uses it: with ``data.prepare.decode: device``, the variant its
    ``on_device(device)`` offers for an encoder on ``device`` (CLIP's decodes JPEGs there), refused where it
    offers none; with ``cpu``, the workers' own."""
    if decode != "device":
        return preprocess
    on_device = getattr(preprocess, "on_device", None)
    chosen = on_device(device) if callable(on_device) else preprocess
    if chosen is preprocess:
        raise PrepareError(
            f"data.prepare.decode: device, but the encoder's preprocessing ({type(preprocess).__name__}) has no "
            f"variant for device {device!r} (CLIP's needs a CUDA device, torchvision installed and a bilinear or "
            f"bicubic processor); set "
            f"data.prepare.decode: cpu"
        )
    return chosen


def encoder_identity(spec: EncoderSpec, dtype: str, preprocess: Any = None) -> dict[str, Any]:
    source = spec.source.identity()
    identity = {
        "encoder": spec.name,
        "encoder_id": source["id"],
        "encoder_revision": source["revision"],
        "tokens": spec.tokens_per_item,
        "width": spec.feature_width,
        "dtype": dtype,
    }
    if preprocess is not None:  # features made through another preprocessing are other features
        identity["preprocess"] = getattr(preprocess, "identity", type(preprocess).__qualname__)
    return identity


def shard_key(identity: Mapping[str, Any], item_hashes: Iterable[str]) -> str:
    """The shard's file stem: a hash of the encoder identity and the ordered media hashes it encodes."""
    payload = json.dumps({"format": SHARD_FORMAT, **identity, "items": list(item_hashes)}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:40]


def write_shard(path: Path, features: torch.Tensor, metadata: Mapping[str, Any]) -> str:
    """Write ``features`` to ``path`` atomically (a temp file in the same directory, then rename), and its sha256
    beside it (``<name>.sha256``); returns the sha256 that readers verify before use."""
    tmp = cache_temp_path(path)
    # one metadata key: safetensors writes a multi-key map in random order, and shards must be byte-stable
    meta = {SHARD_FORMAT: json.dumps(dict(metadata), sort_keys=True)}
    try:
        digest = write_tensor_file(tmp, SHARD_TENSOR, features, meta)
        os.chmod(tmp, 0o644)  # readable like any other prepared file
        write_digest(path, digest)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return digest


# -- the run --------------------------------------------------------------------------------------------


class _Preparation:
    def __init__(
        self, recipe: Recipe, out_dir: Path, spec: EncoderSpec, encoder: Any, device: str, progress: bool,
        prompts: PromptCheck, clock: PhaseClock, frozen: ObjectsFrozen,
    ) -> None:
        self.recipe, self.data, self.spec = recipe, recipe.data, spec
        self.out_dir = out_dir
        self.cache_dir = out_dir / CACHE_DIRNAME
        self.device = device
        # host buffers the encoder's device copies from and to: pinned, so the copies do not block the host
        self.pinned = device.startswith("cuda") and torch.cuda.is_available()
        self.dtype = getattr(torch, self.data.feature_dtype)
        self.element_bytes = torch.empty((), dtype=self.dtype).element_size()
        self.item_bytes = spec.tokens_per_item * spec.feature_width * self.element_bytes
        self._encoder = encoder
        self._encoder_ready = False
        # the encoder's preprocessing for worker processes (its processor config; the weights load only to encode)
        self.preprocess = preprocess_for(spec.preprocess(), device, self.data.prepare.decode)
        self.identity = encoder_identity(spec, self.data.feature_dtype, self.preprocess)
        self.provenance = {
            "encoder": spec.name,
            "encoder_id": self.identity["encoder_id"],
            "encoder_revision": self.identity["encoder_revision"],
            "dataset": self.data.source.describe(),
        }
        self.manifest_lines = ManifestLines(spec.tokens_per_item, spec.feature_width, self.data.feature_dtype,
                                            self.provenance)
        self.progress = progress
        self.referenced: dict[str, int] = {}  # shard name -> bytes
        self.manifest_bytes = 0
        self.peak_transient = 0
        self.rows_scanned = 0
        self.shards_encoded = self.shards_reused = self.items_encoded = self.items_written = 0
        self.rows_written: dict[str, int] = {p.name: 0 for p in self.data.partitions}
        self.rows_unassigned = 0
        self.skipped: list[dict[str, Any]] = []
        self.paths = media_paths(self.data)
        self.prompts = prompts
        self.decoder = RowDecoder(prompts, MediaDecoder(self.paths, spec.decode_item, self.preprocess))
        self.clock = clock
        self.frozen = frozen  # settled at the first shard and when the encoder is loaded
        self.worker_seconds = {"prompt": 0.0, "media": 0.0}  # summed over chunks, whichever process ran them
        self._loading: Future | None = None  # the encoder, loading in a thread while the first rows decode
        self._warming_inputs: Future | None = None  # the device preprocessing's set-up, in a thread beside it
        self.writes: deque[tuple[str, list[_PendingRow], Future | str, int]] = deque()  # shards not yet in manifest
        self.writer: ThreadPoolExecutor | None = None
        # one thread encodes a shard (and hands it to the writer) while this one gathers the next: on a GPU the
        # encoder's own host work (nvjpeg's host half, launches) then overlaps the scanning and the workers' hand-over
        self.encoding: ThreadPoolExecutor | None = None
        self.encode_failed = False  # set by the encode thread: no shard after a failed one is encoded or written
        self.encode_seconds = dict.fromkeys(ENCODE_PHASES, 0.0)  # added to by the encode thread only
        self._bar = threading.Lock()  # the progress bar advances from both threads
        self.slots: SharedSlots | None = None
        self.media_chunks = {"shared_slot": 0, "own_segment": 0}

    def load_encoder(self, warm: bool = False) -> Any:
        """The encoder; ``warm``: also run its optional ``warm_up(batch_size)`` (CUDA context, library handles and
        kernels of the first batch), which the loader thread does so the first shard's encode does not wait for it."""
        encoder = self.spec.load(self.spec.source, self.device, self.dtype)
        if warm and callable(getattr(encoder, "warm_up", None)):
            encoder.warm_up(self.data.encode_batch_size)
        return encoder

    def preload_encoder(self) -> None:
        """Start loading the encoder (weights, CUDA) in a thread when the run must encode: its cache holds no shard
        yet. The decode workers are already running, so loading overlaps decoding the first shard instead of
        following it; a re-run, whose shards may all exist, still loads it only when a shard is missing. A device
        preprocessing's ``warm_up(device)`` (CLIP's: nvjpeg's decoder and the resize's GEMMs, ~0.85 s on the H200)
        runs in a second thread beside the load, not after it: on the H200 the loader, not the gathering, held
        back the first shard."""
        if self._encoder is None and not any(self.cache_dir.glob("*.safetensors")):
            self._loading = _in_thread("stitch-encoder-load", self.load_encoder, True)
            if callable(getattr(self.preprocess, "device_batch", None)) and \
                    callable(warm_inputs := getattr(self.preprocess, "warm_up", None)):
                self._warming_inputs = _in_thread("stitch-inputs-warm-up", warm_inputs, self.device)

    @property
    def encoder(self) -> Any:
        if self._encoder is not None and self._encoder_ready:
            return self._encoder
        if self._encoder is None:  # loaded only when a shard is missing: a full re-run never loads it
            self._encoder = self._loading.result() if self._loading is not None else self.load_encoder()
        if not self._encoder_ready:
            self._encoder_ready = True
            self.frozen.settle()  # the loader's imports frozen with the rest
            rows = sum(p.rows for p in self.data.partitions)
            if self.data.prepare.compiles(self.device, rows):
                if not hasattr(self._encoder, "compile"):
                    raise PrepareError(f"data.prepare.compile: {self.data.prepare.compile} needs an encoder with "
                                       f"compile(batch_size); encoder {self.spec.name!r} has none: set it to auto "
                                       f"or never")
                self._encoder.compile(self.data.encode_batch_size)
        return self._encoder

    def retained(self) -> int:
        in_flight = sum(n for *_, n in self.writes)  # shards being written, estimated from their item count
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
    def scanned_rows(self, stream: Iterable[Mapping[str, Any]]) -> Iterator[_ScannedRow]:
        """Rows in stream order with their text checked; an error is kept with its row, raised when the run
        reaches it (rows read ahead for the decode workers must not change what is reported, or when)."""
        cols = self.data.columns
        rows = iter(itertools.islice(stream_rows(stream), self.data.scan_cap))
        for position in itertools.count():
            with self.clock("scan"):  # reading the stream and checking the row's text
                raw = next(rows, None)
                if raw is None:
                    return
                row = _ScannedRow(f"row{position}", position)
                try:
                    row.id = _row_id(raw, self.recipe, position)
                    _check_columns(raw, self.recipe, row.id)
                    row.messages = _messages(raw, self.recipe, row.id, position)
                    row.extra = _extra(raw, self.recipe, row.id, position)
                    row.values = media_items(raw[cols.media], row.id, position, cols.media)
                except (InvalidRow, PrepareError) as exc:
                    row.error = exc
            yield row

    def decoded_rows(self, rows: Iterator[_ScannedRow], pool: Executor | None) -> Iterator[tuple[_ScannedRow, Any, Any]]:
        """Each scanned row with its token counts (``PromptCheck.measure``) and media result (``(hashes, items)``
        or ``(kind, reason)``; None when its conversation does not tokenize), both None after a text error, in
        stream order. Ahead of the row the run is at, a shard's rows (at least 4 chunks per worker) are decoding,
        so the workers keep busy while the main process encodes and writes a shard."""
        window: deque[tuple[list[_ScannedRow], Any, int | None]] = deque()
        workers = getattr(pool, "_max_workers", 1)
        ahead = 0 if pool is None else chunks_ahead(workers, self.data.shard_rows)
        slots = self.slots  # set only with workers: without a pool no chunk takes or returns a slot

        def done(chunk: list[_ScannedRow], pending: Any, slot: int | None) -> Iterator[tuple[_ScannedRow, Any, Any]]:
            with self.clock("media_wait"):  # with 0 workers: the tokenizing and decoding themselves
                answer = pending.result() if isinstance(pending, Future) else pending() if pending else None
            measured: Iterator[Any] = iter(())
            results: Iterator[Any] = iter(())
            if answer is not None:
                counts, media, stacked, (prompt_s, media_s) = answer
                if isinstance(stacked, SlotRef):
                    self.media_chunks["shared_slot"] += 1
                    if getattr(self.preprocess, "stacks", True):
                        stacked = slots.take(stacked)  # type: ignore[union-attr]
                    else:  # the items' payloads, not a stack (hand_over)
                        media = _taken_over(media, slots.take_payloads(stacked), self.preprocess)  # type: ignore[union-attr]
                        stacked = None
                else:
                    if slot is not None:  # nothing was written into it
                        slots.release(slot)  # type: ignore[union-attr]
                    if stacked is not None and pool is not None:
                        self.media_chunks["own_segment"] += 1
                self.worker_seconds["prompt"] += prompt_s
                self.worker_seconds["media"] += media_s
                measured, results = iter(counts), iter(_unstack(media, stacked))
            for row in chunk:
                yield (row, None, None) if row.error else (row, next(measured), next(results))

        try:
            while chunk := list(itertools.islice(rows, MEDIA_CHUNK_ROWS)):
                todo = [(row.id, row.messages, row.extra, row.values) for row in chunk if row.error is None]
                slot = None
                if not todo:
                    pending = None
                elif pool is None:
                    pending = functools.partial(self.decoder.rows, todo)  # decoded when the run reaches it
                else:
                    slot = slots.acquire() if slots is not None else None
                    pending = pool.submit(_decode_chunk, todo, slot)
                window.append((chunk, pending, slot))
                while len(window) > ahead:
                    yield from done(*window.popleft())
            while window:
                yield from done(*window.popleft())
        finally:
            for _, pending, _ in window:  # the run stopped early (enough rows, or an error): drop what is ahead
                if isinstance(pending, Future):
                    pending.cancel()

    def valid_rows(self, stream: Iterable[Mapping[str, Any]], pool: Executor | None = None) -> Iterator[_PendingRow]:
        """Selected rows in stream order; invalid rows are raised or skipped, never given an ordinal."""
        ordinal, needed = 0, self.data.rows_needed  # a property over the partitions: read once, not per row
        for row, measured, media in self.decoded_rows(self.scanned_rows(stream), pool):
            self.rows_scanned = row.position + 1
            partition = self.data.partition_of(ordinal)  # the one this row takes if it is valid
            try:
                if row.error is not None:
                    raise row.error
                # the prompt is judged before the media, whichever failed first in the worker
                self.prompts.budgets_check(measured, partition and partition.name, row.id, row.position)
                if isinstance(media[0], str):
                    kind, reason = media
                    raise InvalidRow(row.id, row.position, self.data.columns.media, reason, kind)
            except InvalidRow as bad:
                if self.data.on_corrupt == "error":
                    raise PrepareError(
                        f"{bad}. Fix the row, or set data.on_corrupt: skip to count and skip such rows"
                    ) from bad
                self.skipped.append(bad.as_json())
                continue
            ordinal += 1
            if partition is not None:
                hashes, items = media
                yield _PendingRow(row.id, row.position, partition.name, row.messages, items, hashes, row.extra)
            else:
                self.rows_unassigned += 1
            if ordinal >= needed:
                break
        if ordinal < needed:
            short = [p.name for p in self.data.partitions if p.end > ordinal]
            limit = (
                f"the scan cap (data.scan_cap={self.data.scan_cap})"
                if self.rows_scanned >= self.data.scan_cap
                else "the end of the dataset"
            )
            skips = f" Skipped by reason: {describe_skips(self.skipped)}." if self.skipped else ""
            raise PrepareError(
                f"found {ordinal} valid rows before {limit} ({self.rows_scanned} scanned, {len(self.skipped)} "
                f"skipped); partitions {short} need {needed}.{skips} Every skipped row and its "
                f"reason: {self.out_dir / REPORT_NAME}. Raise data.scan_cap, use a larger source, fix the rows, "
                f"or shrink the partitions"
            )

    # -- shards ----------------------------------------------------------------------------------------
    def shards(self, rows: Iterator[_PendingRow]) -> Iterator[list[_PendingRow]]:
        """Consecutive rows of one partition, at most ``shard_rows`` each: a new partition starts a shard."""
        pending: list[_PendingRow] = []
        for row in rows:
            if pending and (pending[0].partition != row.partition or len(pending) >= self.data.shard_rows):
                yield pending
                pending = []
            pending.append(row)
        if pending:
            yield pending

    def flush(self, rows: list[_PendingRow], manifest: Any, bar: Any) -> None:
        """Encode the shard unless it exists; its file is written by the writer thread while the next shard is
        decoded and encoded, and its rows reach the manifest, in order, once the file is in place."""
        name = shard_key(self.identity, (h for r in rows for h in r.hashes)) + ".safetensors"
        path = self.cache_dir / name
        n_items = sum(len(r.media) for r in rows)
        if path.is_file():
            with self.clock("verify_reused"):
                digest: Future | str = verified_shard_digest(path)  # a reused shard must still be the file written
            self.shards_reused += 1
            self.advance(bar, len(rows))
            for row in rows:
                row.media = []  # the decoded items are not needed
            estimate = 0
        else:
            self.check_retained(n_items * self.item_bytes, f"with shard {name} ({rows[0].id}..{rows[-1].id})")
            assert self.encoding is not None
            digest = self.encoding.submit(self.encode_shard, rows, path, n_items, bar)
            self.shards_encoded += 1
            self.items_encoded += n_items
            estimate = n_items * self.item_bytes
        self.writes.append((name, rows, digest, estimate))
        self.record(manifest, keep=1)

    def encode_shard(self, rows: list[_PendingRow], path: Path, n_items: int, bar: Any) -> Future:
        """On the encode thread: the shard's features, handed to the writer thread; the writer's future. After a
        shard whose encode failed, none is encoded: the main thread raises that failure when it reaches the shard,
        and the shards queued behind it, already submitted, must not land in the cache meanwhile (a resume would
        then reuse more than the run finished in order)."""
        if self.encode_failed:
            raise PrepareError(f"not encoded: an earlier shard's encode failed (rows {rows[0].id}..{rows[-1].id})")
        try:
            features = self.encode(rows, bar)
        except BaseException:
            self.encode_failed = True
            raise
        for row in rows:
            row.media = []  # the decoded items are no longer needed (a shared slot is free once its views are gone)
        assert self.writer is not None
        return self.writer.submit(write_shard, path, features, {**self.identity, "items": n_items})

    def advance(self, bar: Any, rows: int) -> None:
        with self._bar:
            bar.update(rows)

    def record(self, manifest: Any, keep: int = 0) -> None:
        """Manifest lines of the written shards, oldest first, leaving ``keep`` shards in flight."""
        while len(self.writes) > keep:
            name, rows, pending, _ = self.writes[0]
            if isinstance(pending, Future):  # the encode thread's answer: the writer's future
                with self.clock("encode_wait"):
                    pending = pending.result()
            with self.clock("write_wait"):
                digest = pending.result() if isinstance(pending, Future) else pending
            self.writes.popleft()
            with self.clock("manifest"):
                self.record_shard(manifest, name, rows, digest)

    def record_shard(self, manifest: Any, name: str, rows: list[_PendingRow], digest: str) -> None:
        """The manifest lines of one written shard's rows, in order."""
        path = self.cache_dir / name
        if name not in self.referenced:  # the shard and its sha256 sidecar are both retained
            self.referenced[name] = path.stat().st_size + shard_digest_path(path).stat().st_size
        index, lines = 0, []
        for row in rows:
            keys = [FeatureKey(name, index + j, digest) for j in range(len(row.hashes))]
            index += len(row.hashes)
            lines.append(self.manifest_lines.line(row.id, row.partition, row.messages, keys, row.extra))
            self.rows_written[row.partition] += 1
        self.items_written += index
        text = "".join(lines)
        manifest.write(text)
        self.manifest_bytes += len(text.encode())
        self.check_retained(0, f"after shard {name}")

    def batch(self, items: list[Any]) -> Any:
        """What one encoder call takes: the list of decoded items, or preprocessed tensors stacked into one
        (in pinned memory when the encoder is on CUDA, so the copy to the device is asynchronous), or the batch a
        preprocessing that finishes on the device (``device_batch``) made there."""
        if self.preprocess is None or not items:  # decode_item's items (a plugin's may differ in shape)
            return items
        if callable(finish := getattr(self.preprocess, "device_batch", None)):
            return finish(items, self.device)
        out = torch.empty((len(items), *items[0].shape), dtype=items[0].dtype, pin_memory=self.pinned)
        with _one_host_thread():
            return torch.stack(items, out=out)

    def encode(self, rows: list[_PendingRow], bar: Any) -> torch.Tensor:
        """Features of every item of ``rows`` in order; the bar advances per row as its last item is done. The
        first batch's input is made before the encoder is waited for: on a fresh run the encoder may still be
        loading when the first shard is gathered."""
        started, inputs = time.perf_counter(), 0.0  # the thread's seconds here, and those making the inputs
        if self._warming_inputs is not None:  # the device preprocessing's set-up finished (or its error raised)
            warming, self._warming_inputs = self._warming_inputs, None
            warming.result()
        waited = time.perf_counter() - started  # start-up, counted as the encoder's loading
        encoder = None
        items = [(row.id, item) for row in rows for item in row.media]
        row_ends = set(itertools.accumulate(len(row.media) for row in rows))
        expected = (self.spec.tokens_per_item, self.spec.feature_width)
        # each batch lands in place (no cat); on a GPU in pinned memory, so a batch's features come back while the
        # host stacks the next batch, and the host waits once, for the last copy
        out = torch.empty((len(items), *expected), dtype=self.dtype, pin_memory=self.pinned)
        step = self.data.encode_batch_size
        for start in range(0, len(items), step):
            batch = items[start : start + step]
            making = time.perf_counter()
            with torch.inference_mode():
                pixels = self.batch([item for _, item in batch])
                inputs += time.perf_counter() - making
                if encoder is None:  # loads (or waits for) the encoder, into encode_seconds' own phase
                    asked = time.perf_counter()
                    encoder = self.encoder
                    waited += time.perf_counter() - asked
                features = encoder.encode(pixels)
            if tuple(features.shape) != (len(batch), *expected):
                raise PrepareError(
                    f"encoder {self.spec.name!r} returned features of shape {tuple(features.shape)} for rows "
                    f"{batch[0][0]}..{batch[-1][0]}; its spec declares ({len(batch)}, {expected[0]}, {expected[1]})"
                )
            with _one_host_thread():
                out[start : start + len(batch)].copy_(features.detach(), non_blocking=features.is_cuda)
            self.advance(bar, sum(1 for end in row_ends if start < end <= start + len(batch)))
        if self.pinned:
            torch.cuda.current_stream().synchronize()  # every copy into ``out`` has landed before it is written
        self.encode_seconds["encoder_load"] += waited
        self.encode_seconds["inputs"] += inputs
        self.encode_seconds["encode"] += time.perf_counter() - started - inputs - waited
        return out

    # -- whole run -------------------------------------------------------------------------------------
    def run(self) -> PrepareReport:
        started = time.perf_counter()
        selected = sum(p.rows for p in self.data.partitions)
        self.check_retained(selected * self.item_bytes, f"for {selected} rows of features (before encoding)")
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        # left by a killed run: ours (.tmp-<pid>-<shard>) and safetensors' own (it writes .tmpXXXXXX, then renames)
        for stale in self.cache_dir.glob(".tmp*"):
            stale.unlink(missing_ok=True)
        manifest_path = self.out_dir / MANIFEST_NAME
        manifest_tmp = self.out_dir / f"{TMP_PREFIX}{MANIFEST_NAME}"
        tmp = Path(tempfile.mkdtemp(prefix="stitch-prepare-"))
        with self.clock("startup"):
            with self.clock("workers_start"):
                # the workers start before any thread of this run (tqdm, the writer, the encoder's loader)
                workers = self.data.prepare.worker_count
                self.slots = media_slots(self.preprocess, workers, self.data.shard_rows)
                pool = media_pool(workers, self.decoder, self.slots)
            self.writer = ThreadPoolExecutor(SHARD_WRITERS, thread_name_prefix="stitch-shard-writer")
            self.encoding = ThreadPoolExecutor(1, thread_name_prefix="stitch-encode")
            self.preload_encoder()
        try:
            with self.clock("stream_open"):
                stream = open_stream(self.data.source, tmp / "datasets")
                stream = _raw_media_stream(stream, self.data.columns.media)
            with open(manifest_tmp, "w", encoding="utf-8") as manifest, _progress(selected, self.progress) as bar:
                for shard_rows in self.shards(self.valid_rows(stream, pool)):
                    if not self.shards_encoded + self.shards_reused:
                        self.frozen.settle()  # the stream's imports (datasets) frozen, collection back on
                    self.flush(shard_rows, manifest, bar)
                    self.check_transient(tmp)
                    with self._bar:
                        bar.set_postfix(encoded=self.shards_encoded, reused=self.shards_reused, refresh=False)
                self.record(manifest)
            self.check_transient(tmp)
            os.replace(manifest_tmp, manifest_path)
        except PrepareError as exc:  # the report says what was scanned and skipped, also when preparation fails
            write_text_atomic(self.out_dir / REPORT_NAME, _json_text({
                "out_dir": str(self.out_dir), "complete": False, "error": str(exc), "rows_scanned": self.rows_scanned,
                "skipped": self.skipped, "skipped_by_reason": skipped_by_reason(self.skipped, first=len(self.skipped)),
            }))
            raise
        finally:
            # a shard being encoded is finished and handed to the writer (those queued behind it are dropped), then
            # a shard being written is finished (or its temp file removed)
            self.encoding.shutdown(wait=True, cancel_futures=True)
            self.writer.shutdown(wait=True)
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
            shutil.rmtree(tmp, ignore_errors=True)
            manifest_tmp.unlink(missing_ok=True)
        # orphans: shards of earlier recipes, and the sidecar of a shard whose rename a killed run never made
        for path in [*self.cache_dir.glob("*.safetensors"), *self.cache_dir.glob("*.safetensors.sha256")]:
            if path.name.removesuffix(".sha256") not in self.referenced:
                path.unlink()
        total_rows = sum(self.rows_written.values())
        retained = self.retained()
        report = PrepareReport(
            out_dir=str(self.out_dir),
            rows=dict(self.rows_written),
            rows_scanned=self.rows_scanned,
            rows_unassigned=self.rows_unassigned,
            skipped=self.skipped,
            skipped_by_reason=skipped_by_reason(self.skipped, first=len(self.skipped)),
            shards_encoded=self.shards_encoded,
            shards_reused=self.shards_reused,
            items_encoded=self.items_encoded,
            peak_transient_bytes=self.peak_transient,
            retained_bytes=retained,
            retained_bytes_per_row=retained / max(total_rows, 1),
            payload_bytes_per_row=self.items_written * self.item_bytes / max(total_rows, 1),
            seconds=time.perf_counter() - started,
            provenance={**self.provenance, "dtype": self.data.feature_dtype, "recipe": self.recipe.name,
                        "recipe_sha256": self.recipe.digest},
            phase_seconds=self.clock.report(),
            worker_seconds={k: round(v, 4) for k, v in self.worker_seconds.items()},
            encode_seconds={k: round(v, 4) for k, v in self.encode_seconds.items()},
            media_chunks=dict(self.media_chunks),
        )
        write_text_atomic(self.out_dir / REPORT_NAME, _json_text(dataclasses.asdict(report)))
        return report


def _json_text(payload: Any) -> str:
    return json.dumps(payload, indent=2) + "\n"


@contextlib.contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Any]:
    from tqdm import tqdm

    with tqdm(total=total, desc="prepare", unit="row", disable=not enabled, leave=False) as bar:
        yield bar


def prepare(
    recipe: Recipe,
    out_dir: Path | str,
    *,
    host: Any = None,
    encoder: Any = None,
    device: str = "cpu",
    progress: bool = True,
) -> PrepareReport:
    """Prepare ``recipe``'s data into ``out_dir`` (``feature-cache/`` + ``manifest.jsonl`` + report).

    ``encoder`` is an already-loaded encoder for ``recipe.encoder`` (otherwise it is loaded on first need).
    Shards already in the cache are reused; once the new manifest is in place, shards it does not
    reference are deleted. One preparation per ``out_dir`` at a time: a second is refused (``RunLock``).
    """
    from stitch.runs.lock import RunLock

    if host is None:
        from stitch.plugins.host import get_host

        host = get_host()
    clock = PhaseClock()
    spec = host.get("encoders", recipe.encoder)
    with clock("tokenizer_load"):
        prompts = PromptCheck(recipe, host, spec.tokens_per_item)  # before the run directory exists: a bad model
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with RunLock(out, "prepare"), ObjectsFrozen() as frozen:
        with clock("startup"):
            run = _Preparation(recipe, out, spec, encoder, device, progress, prompts, clock, frozen)
        return run.run()
