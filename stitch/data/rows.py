"""Preparation's row semantics: the source opened as a stream, each row's columns read and checked, its media paths
confined and fingerprinted, its conversation tokenized as training will. The shard keys and the atomic shard write are
``stitch.data.feature_cache``'s.
``stitch.data.prepare`` runs these over a dataset, in order."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from datasets import DownloadConfig, Json, load_dataset
from jinja2 import TemplateError

from stitch.config.data import BuiltinSource, ColumnMapping, DataSource, HubSource, LocalSource
from stitch.config.recipe import Recipe
from stitch.data.collator import IMAGE_MARKER, image_markers, tokenize_example
from stitch.data.sentinels import SentinelIds
from stitch.kernels.prepare_workers import stack_chunk
from stitch.kernels.shared_slots import SharedSlots, SlotRef
from stitch.plugins.specs import VIDEO_MARKER

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
class PendingRow:
    id: str
    position: int
    partition: str
    messages: list[dict[str, str]]
    media: list[Any]  # decoded items (or the encoder's preprocessed tensors), encoded if the shard is new
    hashes: list[str]
    extra: dict[str, str] = field(default_factory=dict)  # task text columns, e.g. rejected


@dataclass
class ScannedRow:
    """A row as read from the stream, its text checked; its media are decoded in a worker meanwhile."""

    id: str
    position: int
    error: InvalidRow | PrepareError | None = None  # raised when the run reaches this row, in stream order
    messages: list[dict[str, str]] = field(default_factory=list)
    extra: dict[str, str] = field(default_factory=dict)
    values: list[Any] = field(default_factory=list)


# -- streaming ------------------------------------------------------------------------------------------


def open_stream(source: DataSource, cache_dir: Path, builtin: Callable[[BuiltinSource], Path] | None = None) -> Any:
    """A ``datasets`` IterableDataset over the source; every cache it writes goes under ``cache_dir``. A builtin
    source is read from the parquet file ``builtin(source)`` materialises."""
    common: dict[str, Any] = {
        "streaming": True,
        "cache_dir": str(cache_dir),
        "download_config": DownloadConfig(cache_dir=str(cache_dir / "downloads")),
    }
    if isinstance(source, BuiltinSource):
        if builtin is None:
            raise PrepareError(f"data.source.builtin {source.builtin!r}: prepare() was given no builtin= to "
                               f"materialise builtin sources with (expected a callable BuiltinSource -> parquet path)")
        parquet = builtin(source)
        return load_dataset("parquet", data_files=str(parquet), split="train", **common)
    if isinstance(source, LocalSource):
        if not source.path.exists():
            raise PrepareError(f"data.source.path {str(source.path)!r} does not exist")
        where = {"data_dir": str(source.path)} if source.path.is_dir() else {"data_files": str(source.path)}
        return load_dataset(source.format, split=source.split, **where, **common)
    assert isinstance(source, HubSource)
    return load_dataset(source.hub, source.config, revision=source.revision, split=source.split, **common)


def raw_media_stream(stream: Any, media_column: str) -> Any:
    """Ask ``datasets`` for undecoded media (``{bytes, path}``) so the encoder's ``decode_item`` decodes it."""
    features = getattr(stream, "features", None)
    feature = features.get(media_column) if features else None
    undecoded = _undecoded(feature) if feature is not None else None
    return stream if undecoded is None else stream.cast_column(media_column, undecoded)


def _undecoded(feature: Any) -> Any:
    """``feature`` (or the media feature a list holds) with decoding off; None when it decodes no media. A ``Json``
    column (what ``datasets`` infers for a column holding a string in some rows and a list in others) is left
    decoding: undecoded it hands back each value's JSON text, so a path would arrive quoted."""
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
    it formats every row as a table of its own, about twice the time a row in
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
    section: str = "data"  # the recipe section whose allow_paths_outside admits outside paths

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
                                                f"set {self.section}.allow_paths_outside: true to allow it")
            inside = real.is_relative_to(self.root.resolve()) or (self.blobs and real.is_relative_to(self.blobs))
            if not inside:
                raise _BadMedia("path-outside", f"{value!r} is a symlink to {str(real)!r}, outside the dataset "
                                                f"directory {str(self.root)!r}; set "
                                                f"{self.section}.allow_paths_outside: true to allow it")
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


def media_paths(data: Any, section: str = "data") -> MediaPaths:
    """Where ``data``'s media paths may point; ``section`` names its recipe section in errors (``data`` or
    ``datasets.<name>``)."""
    source = data.source
    if isinstance(source, LocalSource):
        root = source.path.parent if source.path.is_file() else source.path  # absolute, symlinks kept
        return MediaPaths(root, data.allow_paths_outside, "local", _snapshot_blobs(source.path), section)
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


_IMAGE_PARTS = {"image", "image_url", "input_image"}  # content-part types that stand for one media item
_VIDEO_PARTS = {"video", "video_url"}  # ... for one video clip (a video encoder's <video> marker)


def _content_text(content: Any) -> str | None:
    """A turn's content as text: a string as it is, or OpenAI-style content parts joined, each image part
    becoming an ``<image>`` marker where it stands (a video part a ``<video>`` marker); None when it is neither."""
    if isinstance(content, str):
        return content
    if isinstance(content, int | float) and not isinstance(content, bool):
        return str(content)  # a JSON column decodes an all-digit answer such as "3" to a number
    if not isinstance(content, list) or not all(isinstance(part, Mapping) for part in content):
        return None
    out = []
    for part in content:
        kind = part.get("type")
        if kind in _IMAGE_PARTS:
            out.append(IMAGE_MARKER)
        elif kind in _VIDEO_PARTS:
            out.append(VIDEO_MARKER)
        elif kind == "text" and isinstance(part.get("text"), str):
            out.append(part["text"])
        else:
            return None
    return "".join(out)


def _messages(raw: Mapping[str, Any], cols: ColumnMapping, row_id: str, position: int) -> list[dict[str, str]]:
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
        role = _turn_field(turn, "role", "from")
        content = _content_text(_turn_field(turn, "content", "value"))
        if role not in _ROLES or content is None:
            raise InvalidRow(row_id, position, cols.messages,
                             f"expected {{role, content}} turns (roles {sorted(_ROLES)}; content text or "
                             f"text/image parts), got {short_value(turn)}", "bad-messages")
        # an "<image>" marker (LLaVA's, or an image content part) stays where it stands: its item goes there
        out.append({"role": _ROLES[role], "content": content.strip()})
    if out[-1]["role"] != "assistant" or not any(m["role"] == "user" for m in out):
        raise InvalidRow(row_id, position, cols.messages, "messages must contain a user turn and end with the "
                                                          "assistant", "bad-messages")
    return out


def _turn_field(turn: Any, *names: str) -> Any:
    """The first of ``names`` a turn holds (not None): parquet rows carry every key of the column's struct."""
    if not isinstance(turn, Mapping):
        return None
    return next((turn[n] for n in names if turn.get(n) is not None), None)


def check_media_count(messages: list[dict[str, str]], values: list[Any], row_id: str, position: int,
                      column: str, marker: str = IMAGE_MARKER) -> None:
    """A conversation with ``marker`` markers (``<image>``; ``<video>`` for a video encoder) must hold one per
    media item (each item goes where its marker stands); one without markers takes its items at the start of the
    first user turn."""
    markers = image_markers(messages, marker)
    if markers and markers != len(values):
        raise InvalidRow(row_id, position, column, f"{markers} {marker} marker(s) in the text but "
                                                   f"{len(values)} media item(s); expected one marker per item",
                         "image-count")


def extra_columns(cols: ColumnMapping) -> dict[str, str]:
    """Text columns kept beside the conversation for the task, as ``ManifestRow.extra`` key -> dataset column
    (``data.columns.rejected``: a dispreferred answer per row, DPO's rejected branch)."""
    column = getattr(cols, "rejected", None)
    return {} if column is None else {"rejected": column}


def _extra(raw: Mapping[str, Any], cols: ColumnMapping, row_id: str, position: int) -> dict[str, str]:
    out = {}
    for key, column in extra_columns(cols).items():
        value = raw[column]
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str) or not value.strip():
            raise InvalidRow(row_id, position, column, f"expected non-empty text (data.columns.{key}), got "
                                                       f"{short_value(value)}", "empty-text")
        out[key] = value
    return out


def _row_id(raw: Mapping[str, Any], cols: ColumnMapping, position: int) -> str:
    column = cols.id
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


def _check_columns(raw: Mapping[str, Any], cols: ColumnMapping, row_id: str) -> None:
    for role in ("media", "question", "answer", "messages", *extra_columns(cols)):
        column = getattr(cols, role)
        if column is not None and column not in raw:
            raise _missing_column(column, role, raw, row_id)


def scan_row(raw: Mapping[str, Any], cols: ColumnMapping, position: int, marker: str = IMAGE_MARKER) -> ScannedRow:
    """One row as read from the stream, its ``cols`` checked; an error is kept with the row (raised when the run
    reaches it, in stream order). ``marker``: the text marker of the encoder's media (``<video>``)."""
    row = ScannedRow(f"row{position}", position)
    try:
        row.id = _row_id(raw, cols, position)
        _check_columns(raw, cols, row.id)
        row.messages = _messages(raw, cols, row.id, position)
        row.extra = _extra(raw, cols, row.id, position)
        row.values = media_items(raw[cols.media], row.id, position, cols.media)
        check_media_count(row.messages, row.values, row.id, position, cols.media, marker)
    except (InvalidRow, PrepareError) as exc:
        row.error = exc
    return row


class PromptCheck:
    """Tokenizes each row as training will (``tokenize_example`` with the recipe's model tokenizer and sentinels,
    given by the caller) and checks it fits the token budget of every stage that reads its partition (alone or in
    a mixture); ``columns`` are those of the dataset whose rows it checks."""

    def __init__(self, recipe: Recipe, tokenizer: Any, sentinel_ids: SentinelIds, tokens_per_item: int, *,
                 columns: ColumnMapping) -> None:
        self.model = recipe.model
        self.tokenizer, self.sentinels, self.tokens = tokenizer, sentinel_ids, tokens_per_item
        self.columns = columns
        self.prompt_column = self.columns.messages or self.columns.question  # the column a prompt error names
        self.errors = (ValueError, TemplateError)  # CollatorError is a ValueError; a chat template may raise
        self.budgets: dict[str, list[tuple[str, int]]] = {}  # partition -> (stage, token_budget)
        for stage, opts in recipe.stages.items():
            budget = getattr(opts, "token_budget", None)
            for partition in opts.mixture if budget is not None else ():
                self.budgets.setdefault(partition, []).append((stage, budget))

    def tokenize(self, conversation: list[dict[str, str]], num_items: int, row_id: str = "?") -> list[int]:
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
            except (ValueError, OSError) as exc:  # an encoder may name the kind (e.g. video-too-long)
                return getattr(exc, "kind", "corrupt-media"), f"corrupt media ({exc})"
            except TypeError as exc:
                return "media-type", str(exc)
        return hashes, items

    def rows(self, chunk: list[list[Any] | None], slots: SharedSlots | None = None,
             slot: int | None = None) -> tuple[list[Any], torch.Tensor | SlotRef | None]:
        """Each row's result (None for a row given as None), packed for the trip back from a worker
        (``stack_chunk``: with ``preprocess``, one stack per chunk, into ``slots``' slot ``slot`` when it fits)."""
        return stack_chunk([None if values is None else self.row(values) for values in chunk], self.preprocess,
                           slots, slot)


RowJob = tuple[str, list[dict[str, str]], dict[str, str], list[Any]]  # id, messages, extra, raw media values


@dataclass(frozen=True)
class RowDecoder:
    """What a decode worker does for each row, in the order the run judges it: tokenize its conversation
    (``PromptCheck.measure``), then, unless that failed, normalise, fingerprint and decode its media
    (``MediaDecoder``). Both are per-row work independent of the rows before, so they leave the main process;
    only the token budgets, which depend on the row's partition (its ordinal among valid rows), stay there."""

    prompts: PromptCheck
    media: MediaDecoder

    def rows(self, chunk: list[RowJob], slots: SharedSlots | None = None,
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
