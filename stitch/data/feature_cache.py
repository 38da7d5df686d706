"""The prepared-data layout: content-addressed safetensors feature shards plus ``manifest.jsonl``.

``DIR/feature-cache/<key>.safetensors`` holds one tensor ``features [items, tokens, width]``; each manifest
line is one row: id, partition, chat messages, feature keys (shard + index), shape, dtype and provenance.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from stitch.plugins.specs import EncoderSpec, TaskRow
from stitch.runs.digest import file_sha256

CACHE_DIRNAME = "feature-cache"
MANIFEST_NAME = "manifest.jsonl"
SHARD_TENSOR = "features"
SHARD_FORMAT = "stitch.feature-shard/1"
TMP_PREFIX = ".tmp-"  # every temp file prepare writes starts so; a new run removes the cache's ``.tmp*``


class FeatureCacheError(ValueError):
    """The manifest or the cache is inconsistent; the message names the row, the shard or the file."""


class UnknownRowError(KeyError):
    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


@dataclass(frozen=True)
class FeatureKey:
    shard: str  # a file name inside the feature cache, never a path
    index: int  # the item's position along the shard's first axis
    sha256: str | None = None  # the shard file's sha256 when it was written; verified before its first read

    def as_json(self) -> dict[str, Any]:
        return {"shard": self.shard, "index": self.index, **({"sha256": self.sha256} if self.sha256 else {})}


# safetensors' names of the dtypes a shard may hold (``data.feature_dtype``)
_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def safetensors_header(name: str, tensor: torch.Tensor, metadata: Mapping[str, str]) -> bytes:
    """The header ``safetensors.torch.save`` writes before one tensor's bytes: the JSON's length (8 bytes, little
    endian), then the compact JSON (``__metadata__`` first), padded with spaces to a multiple of 8 bytes."""
    size = tensor.numel() * tensor.element_size()
    entry = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [0, size]}
    body = {"__metadata__": dict(metadata), name: entry} if metadata else {name: entry}
    text = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_tensor_file(path: Path, name: str, tensor: torch.Tensor, metadata: Mapping[str, str]) -> str:
    """Write one tensor as a safetensors file at ``path`` (the bytes ``safetensors.torch.save_file`` writes) and
    return the file's sha256. The tensor's bytes go to the file straight from its memory while a second thread
    hashes the same memory, so the file is neither copied first nor read back (reading back costs ~0.5 s a 154 MB shard)."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype not in _SAFETENSORS_DTYPES or sys.byteorder != "little":
        return save_file_and_hash(path, name, tensor, metadata)
    header = safetensors_header(name, tensor, metadata)
    data = memoryview(tensor.view(torch.uint8).reshape(-1).numpy())
    digest = hashlib.sha256(header)
    hasher = threading.Thread(target=digest.update, args=(data,), name="stitch-shard-hash", daemon=True)
    with open(path, "wb") as fh:
        fh.write(header)
        hasher.start()  # hashlib lets go of the interpreter lock on large buffers, as the file write does
        try:
            fh.write(data)
        finally:
            hasher.join()
    return digest.hexdigest()


def save_file_and_hash(path: Path, name: str, tensor: torch.Tensor, metadata: Mapping[str, str]) -> str:
    """``write_tensor_file`` through safetensors' own writer, then the file read back for its sha256 (what a dtype
    or a host ``write_tensor_file`` does not write itself gets, and what older caches' shards were written with)."""
    save_file({name: tensor.contiguous()}, str(path), metadata=dict(metadata))
    return file_sha256(path)


def shard_digest_path(shard: Path) -> Path:
    """The sidecar holding a shard's sha256 as written: ``<name>.sha256``."""
    return shard.with_name(shard.name + ".sha256")


def cache_temp_path(path: Path) -> Path:
    """Where ``path`` (a shard or its sidecar) is written before its rename: ``.tmp-<pid>-<name>`` beside it, a
    name the next run's ``.tmp*`` sweep removes when a kill came between the write and the rename."""
    return path.with_name(f"{TMP_PREFIX}{os.getpid()}-{path.name}")


def write_digest(shard: Path, digest: str) -> None:
    """Write ``<name>.sha256`` atomically, through ``cache_temp_path`` as the shard itself is."""
    sidecar = shard_digest_path(shard)
    tmp = cache_temp_path(sidecar)
    tmp.write_text(digest + "\n")
    os.replace(tmp, sidecar)


def verified_shard_digest(shard: Path) -> str:
    """The shard's recorded sha256, after checking the file still has it; refuses a tampered or unrecorded shard."""
    sidecar = shard_digest_path(shard)
    if not sidecar.is_file():
        raise FeatureCacheError(f"feature shard {shard} has no recorded sha256 ({sidecar.name}); delete it and "
                                f"re-run `stitch prepare`")
    recorded = sidecar.read_text().strip()
    actual = file_sha256(shard)
    if actual != recorded:
        raise FeatureCacheError(f"feature shard {shard} was modified after it was written: sha256 {actual}, "
                                f"recorded {recorded}; delete it and re-run `stitch prepare`")
    return recorded


@dataclass(frozen=True)
class ManifestRow:
    """One prepared row; ``messages`` end with the assistant turn that training learns."""

    id: str
    partition: str
    messages: tuple[Mapping[str, str], ...]
    features: tuple[FeatureKey, ...]
    tokens: int  # soft tokens per media item
    width: int  # feature width
    dtype: str
    provenance: Mapping[str, Any]
    # text columns kept beside the conversation for the task (e.g. ``rejected`` for DPO pairs)
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def num_items(self) -> int:
        return len(self.features)

    @property
    def question(self) -> str:
        """The last user turn before the final answer."""
        users = [m["content"] for m in self.messages[:-1] if m["role"] == "user"]
        return users[-1] if users else ""

    @property
    def answer(self) -> str:
        return self.messages[-1]["content"]

    @property
    def prompt_messages(self) -> list[dict[str, str]]:
        """The whole history before the final answer: what rollouts, evaluation and inference render."""
        return [dict(m) for m in self.messages[:-1]]

    def task_row(self) -> TaskRow:
        """What a task (reward, grader, pair source) sees of this row."""
        return TaskRow(self.id, self.question, self.answer, dict(self.extra))

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "partition": self.partition,
            "messages": [dict(m) for m in self.messages],
            "features": [k.as_json() for k in self.features],
            "tokens": self.tokens,
            "width": self.width,
            "dtype": self.dtype,
            "provenance": dict(self.provenance),
            **({"extra": dict(self.extra)} if self.extra else {}),
        }

    @classmethod
    def from_json(cls, record: Mapping[str, Any], where: str = "manifest") -> ManifestRow:
        try:
            row = cls(
                id=str(record["id"]),
                partition=str(record["partition"]),
                messages=tuple({"role": m["role"], "content": m["content"]} for m in record["messages"]),
                features=tuple(FeatureKey(str(k["shard"]), int(k["index"]), k.get("sha256"))
                               for k in record["features"]),
                tokens=int(record["tokens"]),
                width=int(record["width"]),
                dtype=str(record["dtype"]),
                provenance=dict(record.get("provenance", {})),
                extra=dict(record.get("extra", {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            row_id = record.get("id", "?") if isinstance(record, Mapping) else "?"
            raise FeatureCacheError(f"{where}: row {row_id!r} is malformed ({type(exc).__name__}: {exc})") from exc
        for key in row.features:
            check_shard_name(key.shard, row.id, where)
        return row


class ManifestLines:
    """Manifest lines of rows that share their tokens, width, dtype and provenance, as one preparation's rows do:
    those fields are serialised once, and each line equals ``json.dumps(row.as_json())`` of its ``ManifestRow``
    (compact separators, text as written). Provenance is most of a line's bytes, and the lines are written by the
    main process that bounds preparation (9 us a row through ``ManifestRow.as_json``)."""

    def __init__(self, tokens: int, width: int, dtype: str, provenance: Mapping[str, Any]) -> None:
        shared = _json({"tokens": tokens, "width": width, "dtype": dtype, "provenance": dict(provenance)})
        self._shared = "," + shared[1:-1]

    def line(self, row_id: str, partition: str, messages: Iterable[Mapping[str, str]], features: Iterable[FeatureKey],
             extra: Mapping[str, Any] | None = None) -> str:
        head = _json({"id": row_id, "partition": partition, "messages": [dict(m) for m in messages],
                      "features": [k.as_json() for k in features]})
        tail = ',"extra":' + _json(dict(extra)) if extra else ""
        return head[:-1] + self._shared + tail + "}\n"


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def check_shard_name(name: str, row_id: str = "?", where: str = "manifest") -> str:
    """Refuse a feature key that is not a plain file name inside the cache (``../x``, ``/abs``, ``a/b``)."""
    if (
        not name
        or name in {".", ".."}
        or "/" in name
        or "\\" in name
        or os.path.isabs(name)
        or not name.endswith(".safetensors")
    ):
        raise FeatureCacheError(
            f"{where}: row {row_id!r} has feature shard {name!r}, which is not a plain '<key>.safetensors' "
            f"file name inside the feature cache; refusing a path that could escape the cache root"
        )
    return name


def iter_manifest(path: Path, partition: str | None = None) -> Iterator[ManifestRow]:
    """Rows of ``manifest.jsonl``, read lazily line by line, optionally only one partition."""
    with open(path, encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise FeatureCacheError(f"{path}:{lineno}: not valid JSON ({exc})") from exc
            row = ManifestRow.from_json(record, f"{path}:{lineno}")
            if partition is None or row.partition == partition:
                yield row


class PreparedData:
    """A prepared directory: the manifest (indexed by row id) and its feature cache."""

    def __init__(self, root: Path | str, max_open_shards: int = 8) -> None:
        self.root = Path(root)
        self.manifest_path = self.root / MANIFEST_NAME
        self.cache = FeatureCache(self.root / CACHE_DIRNAME, max_open_shards=max_open_shards)
        if not self.manifest_path.is_file():
            raise FeatureCacheError(
                f"{self.manifest_path} does not exist; run `stitch prepare --recipe ... --out {self.root}`"
            )
        self._rows: dict[str, ManifestRow] | None = None

    def rows(self, partition: str | None = None) -> Iterator[ManifestRow]:
        return iter_manifest(self.manifest_path, partition)

    def row(self, row_id: str) -> ManifestRow:
        if self._rows is None:
            self._rows = {r.id: r for r in self.rows()}
        if row_id not in self._rows:
            some = ", ".join(list(self._rows)[:3])
            raise UnknownRowError(
                f"row id {row_id!r} is not in {self.manifest_path} ({len(self._rows)} rows, e.g. {some})"
            )
        return self._rows[row_id]

    def features(self, row: ManifestRow | str) -> torch.Tensor:
        if isinstance(row, str):
            row = self.row(row)
        return self.cache.load(row)


class FeatureCache:
    """Reads feature items by key; keeps a few shards open (safetensors reads slices lazily)."""

    def __init__(self, root: Path | str, max_open_shards: int = 8) -> None:
        self.root = Path(root).resolve()
        self.max_open_shards = max_open_shards
        self._open: OrderedDict[str, Any] = OrderedDict()
        self._verified: set[str] = set()

    def shard_path(self, name: str, row_id: str = "?") -> Path:
        path = (self.root / check_shard_name(name, row_id)).resolve()
        if path.parent != self.root:  # a symlinked name would land elsewhere
            raise FeatureCacheError(f"row {row_id!r}: shard {name!r} resolves outside {self.root}; refusing")
        return path

    def _handle(self, name: str, row_id: str, sha256: str | None = None) -> Any:
        if name in self._open:
            self._open.move_to_end(name)
            return self._open[name]
        path = self.shard_path(name, row_id)
        if not path.is_file():
            raise FeatureCacheError(f"row {row_id!r}: feature shard {path} is missing; re-run `stitch prepare`")
        if sha256 is not None and name not in self._verified:  # once per process: hashing is a full read
            actual = file_sha256(path)
            if actual != sha256:
                raise FeatureCacheError(f"row {row_id!r}: feature shard {path} has sha256 {actual}, but the manifest "
                                        f"recorded {sha256} when it was written; it was modified: re-run "
                                        f"`stitch prepare`")
            self._verified.add(name)
        handle = safe_open(str(path), framework="pt")
        self._open[name] = handle
        while len(self._open) > self.max_open_shards:
            self._open.popitem(last=False)
        return handle

    def load_keys(self, keys: Sequence[FeatureKey], row_id: str = "?") -> torch.Tensor:
        """Items ``[len(keys), tokens, width]`` in key order."""
        items = []
        for key in keys:
            sliced = self._handle(key.shard, row_id, key.sha256).get_slice(SHARD_TENSOR)
            size = sliced.get_shape()[0]
            if not 0 <= key.index < size:
                raise FeatureCacheError(
                    f"row {row_id!r}: index {key.index} is out of range for shard {key.shard} ({size} items)"
                )
            items.append(sliced[key.index : key.index + 1])
        if not items:
            raise FeatureCacheError(f"row {row_id!r} has no feature keys")
        return torch.cat(items)

    def load(self, row: ManifestRow) -> torch.Tensor:
        """A row's features ``[items, tokens, width]``, checked against the shape the manifest declares."""
        features = self.load_keys(row.features, row.id)
        expected = (row.num_items, row.tokens, row.width)
        if tuple(features.shape) != expected:
            raise FeatureCacheError(
                f"row {row.id!r}: cached features have shape {tuple(features.shape)}, manifest says {expected}"
            )
        return features


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
