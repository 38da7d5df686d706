"""The data section of a recipe: where rows come from (a builtin generator, a local path or a pinned hub dataset),
which columns matter, how valid rows split into named partitions, and preparation's memory bounds and workers; or
several named datasets (``datasets:``), each with its own source, columns and row checks, prepared into one cache."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from annotated_types import Ge, Le
from pydantic import (
    BeforeValidator,
    Discriminator,
    Field,
    PlainSerializer,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass

from stitch.config.describe import CHOICE_ERROR, field_error
from stitch.config.options import (
    STRICT_DATACLASS,
    Flag,
    Int,
    NonNegativeInt,
    PositiveInt,
    PositiveNumber,
    Text,
)

FeatureDtype = Literal["float16", "bfloat16", "float32"]
SourceFormat = Literal["parquet", "arrow", "json", "imagefolder"]
BuiltinDataset = Literal["counting-shapes", "shape-colors"]
OnCorrupt = Literal["error", "skip"]
CompileChoice = Literal["auto", "always", "never"]
DecodeChoice = Literal["cpu", "device"]
COMPILE_AUTO_ITEMS = 100_000  # compiling the tower costs tens of seconds; below this many items it does not pay
_SHA = re.compile(r"^[0-9a-f]{40}$")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


# -- data sources -------------------------------------------------------------------------------------------


@dataclass(frozen=True, config=STRICT_DATACLASS)
class BuiltinSource:
    """A dataset stitch generates itself (the demo), written to disk and read like user data."""

    builtin: BuiltinDataset = Field(description="a dataset stitch generates (the counting demo)")
    rows: PositiveInt = Field(description="rows generated")
    caption_rows: Annotated[Int, Ge(0)] = Field(0, description="leading rows that ask for a caption, not a count")
    seed: Int = Field(0, description="generator seed")
    annotator_rows: tuple[Annotated[Int, Ge(0)], Annotated[Int, Ge(0)]] | None = Field(
        None, description="(counting-shapes) rows [start, end) labelled by a simulated annotator instead of the "
        "scene's true count; null: every row carries the true count")
    annotator_undercount: Annotated[float, Ge(0), Le(1)] = Field(
        0.0, description="(counting-shapes) probability that the annotator labels a scene of the most objects "
        "(8) one too few")

    @model_validator(mode="after")
    def _captions_fit(self) -> BuiltinSource:
        if self.caption_rows > self.rows:
            raise field_error("caption_rows", f"an integer in [0, rows={self.rows}]", self.caption_rows)
        if self.annotator_rows is not None:
            start, end = self.annotator_rows
            if self.builtin != "counting-shapes":
                raise field_error("annotator_rows", "null (only counting-shapes has an annotator)",
                                  list(self.annotator_rows))
            if not start < end <= self.rows:
                raise field_error("annotator_rows", f"[start, end] with start < end <= rows={self.rows}",
                                  list(self.annotator_rows))
        return self

    def generator_options(self) -> dict[str, Any]:
        """Keyword arguments of the generator beyond rows, caption rows and seed (only those set)."""
        if self.annotator_rows is None:
            return {}
        return {"annotator_rows": tuple(self.annotator_rows), "undercount": self.annotator_undercount}

    def describe(self) -> str:
        extra = "".join(f",{k}={v}" for k, v in self.generator_options().items())
        return f"builtin:{self.builtin}(rows={self.rows},caption_rows={self.caption_rows},seed={self.seed}{extra})"


@dataclass(frozen=True, config=STRICT_DATACLASS)
class LocalSource:
    """A local file or directory read through a ``datasets`` packaged builder."""

    path: Path = Field(description="a file or directory; relative paths resolve against the recipe file's folder")
    format: SourceFormat = Field(description="the `datasets` builder that reads it")
    split: Text = Field("train", description="split name")

    @field_validator("path", mode="after")
    @classmethod
    def _absolute(cls, value: Path, info: ValidationInfo) -> Path:
        if not value.is_absolute():
            base = (info.context or {}).get("base_dir") or Path.cwd()
            value = Path(base) / value
        # absolute, but symlinks kept: media paths resolve against the directory the user named (a hub snapshot's
        # files are symlinks into its blobs/, and its relative paths mean the snapshot's layout)
        return Path(os.path.abspath(value))

    def describe(self) -> str:
        return f"{self.format}:{self.path}"


@dataclass(frozen=True, config=STRICT_DATACLASS)
class HubSource:
    """A hub dataset pinned to a commit."""

    hub: Text = Field(description="a hub dataset id such as 'org/name'")
    revision: Text = Field(description="a pinned 40-hex commit sha (branches and tags move)")
    config: Text | None = Field(None, description="dataset configuration name")
    split: Text = Field("train", description="split name")

    @model_validator(mode="after")
    def _pinned(self) -> HubSource:
        if "/" not in self.hub:
            raise field_error("hub", "a hub dataset id such as 'org/name'", self.hub)
        if not _SHA.match(self.revision):
            raise field_error("revision", "a pinned 40-hex commit sha (branches and tags move)", self.revision)
        return self

    def describe(self) -> str:
        config = f"/{self.config}" if self.config else ""
        return f"hub:{self.hub}{config}@{self.revision}[{self.split}]"


_SOURCE_KINDS: dict[str, type] = {"builtin": BuiltinSource, "path": LocalSource, "hub": HubSource}


def _source_kind(value: Any) -> str | None:
    """The union tag of a data source: its class, or the one kind key its mapping holds."""
    for key, cls in _SOURCE_KINDS.items():
        if isinstance(value, cls):
            return f"{key} source"
    if isinstance(value, Mapping):
        keys = [k for k in _SOURCE_KINDS if k in value]
        return f"{keys[0]} source" if len(keys) == 1 else None
    return None


DataSource = Annotated[
    Union[  # noqa: UP007  (a tagged union needs the Union spelling)
        Annotated[BuiltinSource, Tag("builtin source")],
        Annotated[LocalSource, Tag("path source")],
        Annotated[HubSource, Tag("hub source")],
    ],
    Discriminator(_source_kind, custom_error_type=CHOICE_ERROR,
                  custom_error_message="exactly one of 'builtin', 'path' or 'hub'"),
]


# -- data -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, config=STRICT_DATACLASS)
class ColumnMapping:
    """Which dataset columns hold the media, the text (question + answer, or chat messages) and the row id."""

    media: Text = Field(description="column holding the media item (image bytes, path...)")
    question: Text | None = Field(None, description="column holding the prompt text (with answer)")
    answer: Text | None = Field(None, description="column holding the reference answer (with question)")
    messages: Text | None = Field(None, description="column of chat messages, instead of question + answer")
    id: Text | None = Field(None, description="column holding a stable row id; null: the stream position")
    rejected: Text | None = Field(None, description="column holding a rejected answer (DPO pairs from the data)")

    @model_validator(mode="after")
    def _text_columns(self) -> ColumnMapping:
        has_qa = self.question is not None or self.answer is not None
        if self.messages is not None and has_qa:
            raise field_error("messages", "either 'messages' or 'question' + 'answer', not both", self.messages)
        if self.messages is None and (self.question is None or self.answer is None):
            missing = "question" if self.question is None else "answer"
            raise field_error(missing, "a column name (or map 'messages' to a chat-messages column instead of "
                                       "question + answer)")
        return self

    @property
    def text_columns(self) -> tuple[str, ...]:
        if self.messages is not None:
            return (self.messages,)
        return (self.question, self.answer)  # type: ignore[return-value]


@dataclass(frozen=True, config=STRICT_DATACLASS)
class Partition:
    """Valid-row ordinals ``[start, end)`` that make up one named slice of the prepared data."""

    name: Text
    start: Annotated[Int, Ge(0)]
    end: PositiveInt

    def __contains__(self, ordinal: int) -> bool:
        return self.start <= ordinal < self.end

    @property
    def rows(self) -> int:
        return self.end - self.start


def _partitions(value: Any) -> tuple[Partition, ...]:
    """``{name: [start, end]}`` (or Partitions already built) -> partitions sorted by start, never overlapping."""
    if isinstance(value, Mapping):
        parts = []
        for name, bounds in value.items():
            if not isinstance(name, str) or not _NAME.match(name):
                raise field_error(str(name), "a partition name (letters, digits, _ . -)", name)
            ok = (isinstance(bounds, list | tuple) and len(bounds) == 2
                  and all(isinstance(v, int) and not isinstance(v, bool) for v in bounds)
                  and 0 <= bounds[0] < bounds[1])
            if not ok:
                raise field_error(name, "[start, end) valid-row ordinals with 0 <= start < end", bounds)
            parts.append(Partition(name, bounds[0], bounds[1]))
    elif isinstance(value, Sequence) and not isinstance(value, str) and all(isinstance(p, Partition) for p in value):
        parts = list(value)
    else:
        raise field_error("", "a mapping of partition name to [start, end), e.g. {sft: [0, 320]}", value)
    if not parts:
        raise field_error("", "at least one partition, e.g. {sft: [0, 320]}", dict(value) if value else value)
    parts.sort(key=lambda p: p.start)
    for before, after in zip(parts, parts[1:], strict=False):
        if after.start < before.end:
            raise field_error("", "partitions that do not overlap (a valid row belongs to at most one)",
                              {before.name: [before.start, before.end], after.name: [after.start, after.end]})
    return tuple(parts)


def _partitions_as_mapping(parts: tuple[Partition, ...]) -> dict[str, list[int]]:
    """Partitions written back as a recipe spells them."""
    return {p.name: [p.start, p.end] for p in parts}


Partitions = Annotated[
    tuple[Partition, ...], BeforeValidator(_partitions, json_schema_input_type=dict[str, tuple[int, int]]),
    PlainSerializer(_partitions_as_mapping, return_type=dict[str, list[int]]),
]


@dataclass(frozen=True, config=STRICT_DATACLASS)
class Budgets:
    """Memory bounds of preparation: what may be in flight, and what the feature cache may keep."""

    transient_mib: PositiveNumber = Field(description="peak in-flight bytes while preparing (MiB)")
    retained_mib: PositiveNumber = Field(description="feature cache + manifest size bound (MiB)")

    @property
    def transient_bytes(self) -> int:
        return int(self.transient_mib * 2**20)

    @property
    def retained_bytes(self) -> int:
        return int(self.retained_mib * 2**20)


def default_prepare_workers() -> int:
    """Decode workers when the recipe names none: one core stays with the main process (streaming, row checks,
    the encoder's host side), at most 16 (JPEG decoding is the bottleneck: a GPU encodes ~10x faster)."""
    return max(0, min(16, (os.cpu_count() or 1) - 1))


@dataclass(frozen=True, config=STRICT_DATACLASS)
class PrepareOptions:
    """How ``stitch prepare`` spreads its work: decode worker processes and the encoder's compilation."""

    workers: NonNegativeInt | None = Field(None, description="processes that decode and resize media (0: in the "
                                                             "main process; unset: min(16, CPUs - 1))")
    compile: CompileChoice = Field("auto", description="torch.compile the encoder: auto compiles on CUDA when "
                                                       f"at least {COMPILE_AUTO_ITEMS} rows are selected")
    decode: DecodeChoice = Field("cpu", description="where media are decoded: cpu in the workers; device lets the "
                                                    "encoder's preprocessing finish on its device (CLIP: JPEGs by "
                                                    "nvjpeg on a CUDA GPU, needs torchvision and a bilinear or bicubic "
                                                    "processor): for hosts with few CPU cores per GPU")

    @property
    def worker_count(self) -> int:
        return default_prepare_workers() if self.workers is None else self.workers

    def compiles(self, device: str, rows: int) -> bool:
        if self.compile == "auto":
            return device.startswith("cuda") and rows >= COMPILE_AUTO_ITEMS
        return self.compile == "always"


@dataclass(frozen=True, config=STRICT_DATACLASS)
class DataConfig:
    """Where rows come from, which columns matter, how they split into partitions, and preparation's bounds. In a
    recipe that declares ``datasets``, only the shared fields are set here (budgets, feature dtype, batch and shard
    sizes, decode workers; on_corrupt and allow_paths_outside as the datasets' defaults)."""

    source: DataSource | None = Field(None, description="exactly one of builtin / path / hub (null: the recipe "
                                                        "declares datasets instead)")
    columns: ColumnMapping | None = Field(None, description="dataset column names (with source)")
    partitions: Partitions | None = Field(None, description="name -> [start, end) valid-row ordinals; "
                                                             "non-overlapping (with source)")
    scan_cap: PositiveInt | None = Field(None, description="rows scanned at most (valid or not); at least the last "
                                                           "partition end (with source)")
    budgets: Budgets = Field(description="memory bounds of preparation (of every dataset together)")
    on_corrupt: OnCorrupt = Field("error", description="a corrupt row stops preparation, or is "
                                                                       "skipped and reported")
    feature_dtype: FeatureDtype = Field("float32", description="feature cache dtype")
    encode_batch_size: PositiveInt = Field(256, description="items per encoder call")
    shard_rows: PositiveInt = Field(256, description="rows per feature-cache shard")
    allow_paths_outside: Flag = Field(False, description="media paths of a local source may leave its directory "
                                                         "(absolute, ../ or a symlink); false: such rows are refused")
    prepare: PrepareOptions = Field(default_factory=PrepareOptions, description="decode workers and encoder "
                                                                                "compilation of stitch prepare")

    @model_validator(mode="after")
    def _enough_rows(self) -> DataConfig:
        if self.source is None:
            for key in ("columns", "partitions", "scan_cap"):
                if getattr(self, key) is not None:
                    raise field_error(key, "null without data.source (each dataset under datasets names its own)",
                                      getattr(self, key))
            return self
        for key, expected in (("columns", "the dataset's column names, e.g. {media: image, question: q, answer: a}"),
                              ("partitions", "a mapping of partition name to [start, end), e.g. {sft: [0, 320]}"),
                              ("scan_cap", "the rows scanned at most (at least the last partition's end)")):
            if getattr(self, key) is None:
                raise field_error(key, f"{expected} beside data.source")
        need = self.rows_needed
        if self.scan_cap < need:
            raise field_error("scan_cap", f"at least {need} (partitions end at valid row {need})", self.scan_cap)
        if isinstance(self.source, BuiltinSource) and self.source.rows < need:
            raise field_error("source.rows", f"at least {need} (partitions end at valid row {need})",
                              self.source.rows)
        return self

    @property
    def rows_needed(self) -> int:
        """Valid rows the scan must find: the end of the last partition."""
        return max(p.end for p in self.partitions or ())

    def partition_of(self, ordinal: int) -> Partition | None:
        for part in self.partitions or ():
            if ordinal in part:
                return part
        return None

    def partition(self, name: str) -> Partition:
        for part in self.partitions or ():
            if part.name == name:
                return part
        raise KeyError(f"no partition {name!r}; the recipe has {', '.join(p.name for p in self.partitions or ())}")

    def with_dataset(self, name: str, dataset: DatasetConfig) -> DataConfig:
        """The complete single-source config of one named dataset: its own source, columns, row checks and
        partitions (named ``<dataset>`` for ``rows: N``, ``<dataset>.<partition>`` otherwise), and this config's
        shared preparation fields."""
        if dataset.partitions is None:
            parts: tuple[Partition, ...] = (Partition(name, 0, dataset.rows),)  # type: ignore[arg-type]
        else:
            parts = tuple(Partition(f"{name}.{p.name}", p.start, p.end) for p in dataset.partitions)
        return dataclasses.replace(
            self, source=dataset.source, columns=dataset.columns, partitions=parts,
            scan_cap=dataset.scan_cap or max(p.end for p in parts),
            on_corrupt=dataset.on_corrupt or self.on_corrupt,
            allow_paths_outside=(self.allow_paths_outside if dataset.allow_paths_outside is None
                                 else dataset.allow_paths_outside))


@dataclass(frozen=True, config=STRICT_DATACLASS)
class DatasetConfig:
    """One named dataset of a recipe's ``datasets``: its source, columns, the valid rows it takes (``rows``, or
    named ``partitions``) and its row checks; stages name it in ``stages.<stage>.data``."""

    source: DataSource = Field(description="exactly one of builtin / path / hub")
    columns: ColumnMapping = Field(description="dataset column names")
    rows: PositiveInt | None = Field(None, description="the first N valid rows, one partition named after the "
                                                       "dataset (instead of partitions)")
    partitions: Partitions | None = Field(None, description="name -> [start, end) valid-row ordinals, each named "
                                                             "<dataset>.<name> (instead of rows)")
    scan_cap: PositiveInt | None = Field(None, description="rows scanned at most (valid or not); null: exactly "
                                                           "the rows the partitions need (no row may be invalid)")
    on_corrupt: OnCorrupt | None = Field(None, description="a corrupt row stops preparation, or is skipped and "
                                                           "reported; null: data.on_corrupt")
    allow_paths_outside: Flag | None = Field(None, description="media paths may leave the source's directory; "
                                                               "null: data.allow_paths_outside")

    @model_validator(mode="after")
    def _rows_given(self) -> DatasetConfig:
        if (self.rows is None) == (self.partitions is None):
            raise field_error("rows", "exactly one of rows (the first N valid rows) or partitions "
                                      "({name: [start, end)})", {"rows": self.rows, "partitions": self.partitions})
        for part in self.partitions or ():
            if "." in part.name:
                raise field_error(f"partitions.{part.name}", "a partition name without '.' (stages name it "
                                                             "<dataset>.<partition>)", part.name)
        need = self.rows or max(p.end for p in self.partitions or ())
        if self.scan_cap is not None and self.scan_cap < need:
            raise field_error("scan_cap", f"at least {need} (partitions end at valid row {need})", self.scan_cap)
        if isinstance(self.source, BuiltinSource) and self.source.rows < need:
            raise field_error("source.rows", f"at least {need} (partitions end at valid row {need})",
                              self.source.rows)
        return self


DATASET_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")  # no '.': <dataset>.<partition> names a partition


def complete_datasets(data: DataConfig, datasets: Mapping[str, DatasetConfig] | None) -> dict[str, DataConfig]:
    """Each dataset as one complete single-source config (``DataConfig.with_dataset``), in recipe order; a recipe
    without ``datasets`` has one, its ``data``, named ``data``."""
    if datasets is None:
        return {"data": data}
    return {name: data.with_dataset(name, ds) for name, ds in datasets.items()}
