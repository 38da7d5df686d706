"""Recipes: one YAML file per run, validated by one pydantic schema (``RecipeFile``) into a frozen ``Recipe``.

``key=value`` overrides apply to the YAML mapping before validation; every refusal is one ``RecipeError`` naming
the file, the dotted field path, what was expected and what was found. The digest hashes the resolved recipe.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass as plain_dataclass
from dataclasses import field as plain_field
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from annotated_types import Ge, Le
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    create_model,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass

from stitch.config.describe import CHOICE_ERROR, field_error, format_validation_error, short_repr
from stitch.config.options import (
    STAGE_OPTIONS,
    Flag,
    Int,
    NonNegativeInt,
    PositiveInt,
    PositiveNumber,
    StageOptions,
    Strict,
    Text,
)
from stitch.config.yaml_io import read_yaml_file
from stitch.plugins.registry import Registry
from stitch.plugins.specs import RecipeSpec

FeatureDtype = Literal["float16", "bfloat16", "float32"]
SourceFormat = Literal["parquet", "json", "imagefolder"]
BuiltinDataset = Literal["counting-shapes", "shape-colors"]
OnCorrupt = Literal["error", "skip"]
CompileChoice = Literal["auto", "always", "never"]
DecodeChoice = Literal["cpu", "device"]
COMPILE_AUTO_ITEMS = 100_000  # compiling the tower costs tens of seconds; below this many items it does not pay
DEFAULT_TASK = "exact-match"  # a recipe that names no task is graded by normalised exact match of the answer
_SHA = re.compile(r"^[0-9a-f]{40}$")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_CALLABLE = re.compile(r"^.+:[A-Za-z_][A-Za-z0-9_]*$")
_DATACLASS_CONFIG = ConfigDict(extra="forbid")


class RecipeError(ValueError):
    """A recipe is malformed; the message names the file, the field, what was expected and what was found."""


# -- the base model ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, config=_DATACLASS_CONFIG)
class ModelConfig:
    """A registered model read from a local snapshot directory instead of its pinned hub source (offline use, or
    a snapshot written by `stitch snapshot`)."""

    name: Annotated[Text, Field(min_length=1)] = Field(description="a registered model (see `stitch models`)")
    snapshot: Path | None = Field(
        None, description="a local HF-format snapshot directory (config.json + safetensors) read instead of the "
                          "model's hub source; relative paths resolve against the recipe file's folder. Refused at "
                          "load when it lacks config.json or safetensors, or its hidden size is not the model's")
    backend: Literal["transformers", "automodel"] = Field(
        "transformers", description="the LM implementation: transformers' class, or NeMo AutoModel's (an extra of "
                                    "the model plugin, e.g. stitch-qwen[automodel]); refused at load when the "
                                    "model's plugin offers no such backend, its package does not import, or a "
                                    "stage needs what the backend lacks (generation: GRPO, eval_partition)")

    @field_validator("snapshot", mode="after")
    @classmethod
    def _absolute(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        if value is not None and not value.is_absolute():
            base = (info.context or {}).get("base_dir") or Path.cwd()
            value = Path(base) / value
        return None if value is None else value.resolve()


def _model_config(value: Any) -> Any:
    """A bare model name is the short form of ``{name: ...}``."""
    return {"name": value} if isinstance(value, str) else value


ModelField = Annotated[ModelConfig, BeforeValidator(_model_config, json_schema_input_type=str | ModelConfig)]


# -- data sources -------------------------------------------------------------------------------------------


@dataclass(frozen=True, config=_DATACLASS_CONFIG)
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


@dataclass(frozen=True, config=_DATACLASS_CONFIG)
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


@dataclass(frozen=True, config=_DATACLASS_CONFIG)
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


@dataclass(frozen=True, config=_DATACLASS_CONFIG)
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


@dataclass(frozen=True, config=_DATACLASS_CONFIG)
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


@dataclass(frozen=True, config=_DATACLASS_CONFIG)
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


@dataclass(frozen=True, config=_DATACLASS_CONFIG)
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


@dataclass(frozen=True, config=_DATACLASS_CONFIG)
class DataConfig:
    """Where rows come from, which columns matter, how they split into partitions, and preparation's bounds."""

    source: DataSource = Field(description="exactly one of builtin / path / hub")
    columns: ColumnMapping = Field(description="dataset column names")
    partitions: Annotated[
        tuple[Partition, ...],
        BeforeValidator(_partitions, json_schema_input_type=dict[str, tuple[int, int]]),
    ] = Field(description="name -> [start, end) valid-row ordinals; non-overlapping")
    scan_cap: PositiveInt = Field(description="rows scanned at most (valid or not); at least the last partition end")
    budgets: Budgets = Field(description="memory bounds of preparation")
    on_corrupt: OnCorrupt = Field("error", description="a corrupt row stops preparation, or is "
                                                                       "skipped and reported")
    feature_dtype: FeatureDtype = Field("float32", description="feature cache dtype")
    encode_batch_size: PositiveInt = Field(256, description="items per encoder call")
    shard_rows: PositiveInt = Field(256, description="rows per feature-cache shard")
    allow_paths_outside: Flag = Field(False, description="media paths of a local source may leave its directory "
                                                         "(absolute, ../ or a symlink); false: such rows are refused")
    prepare: PrepareOptions = Field(default_factory=PrepareOptions, description="decode workers and encoder "
                                                                                "compilation of stitch prepare")

    @field_serializer("partitions")
    def _partitions_as_mapping(self, parts: tuple[Partition, ...]) -> dict[str, list[int]]:
        return {p.name: [p.start, p.end] for p in parts}

    @model_validator(mode="after")
    def _enough_rows(self) -> DataConfig:
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
        return max(p.end for p in self.partitions)

    def partition_of(self, ordinal: int) -> Partition | None:
        for part in self.partitions:
            if ordinal in part:
                return part
        return None

    def partition(self, name: str) -> Partition:
        for part in self.partitions:
            if part.name == name:
                return part
        raise KeyError(f"no partition {name!r}; the recipe has {', '.join(p.name for p in self.partitions)}")


# -- task and parallel layout ------------------------------------------------------------------------------


def _task_from_name(value: Any) -> Any:
    """`task: counting` is short for `task: {name: counting}`."""
    return {"name": value} if isinstance(value, str) else value


@dataclass(frozen=True, config=_DATACLASS_CONFIG)
class TaskConfig:
    """What the recipe is trained and judged on: a registered task, or a reward (and grader) as module:function."""

    name: Text | None = Field(None, description="a registered task (see `stitch registry tasks`)")
    reward: Text | None = Field(None, description="GRPO reward as 'module:function' (instead of name)")
    grade: Text | None = Field(None, description="evaluation grader as 'module:function' (with reward; default: "
                                                 "the reward)")

    @model_validator(mode="after")
    def _one_source(self) -> TaskConfig:
        if (self.name is None) == (self.reward is None):
            raise field_error("", "exactly one of 'name' or 'reward'", {"name": self.name, "reward": self.reward})
        if self.name is not None and self.grade is not None:
            raise field_error("grade", "no grader beside a named task (the task brings its own)", self.grade)
        for key in ("reward", "grade"):
            value = getattr(self, key)
            if value is not None and not _CALLABLE.match(value):
                raise field_error(key, "'module:function'", value)
        return self


TaskField = Annotated[TaskConfig, BeforeValidator(_task_from_name, json_schema_input_type=str | TaskConfig)]


@dataclass(frozen=True, config=_DATACLASS_CONFIG)
class GpuRoles:
    """GPUs per GRPO role."""

    policy: PositiveInt = Field(1, description="GPUs of the trained policy")
    rollout: PositiveInt = Field(1, description="GPUs of each rollout replica")


@dataclass(frozen=True, config=_DATACLASS_CONFIG)
class ParallelConfig:
    """How a recipe expects to be launched; ``stitch.config.validate`` checks the arithmetic before anything runs.

    Unset sizes resolve at launch: ``world_size`` from torchrun's WORLD_SIZE, ``data_parallel`` to
    ``world_size / tensor_parallel``. ``gpus`` + ``rollout_replicas`` place GRPO's roles.
    """

    world_size: PositiveInt | None = Field(None, description="processes in the launch; null: torchrun decides")
    data_parallel: PositiveInt | None = Field(None, description="data-parallel ranks; null: world_size / "
                                                                "tensor_parallel")
    tensor_parallel: PositiveInt = Field(1, description="tensor-parallel size (> 1 not implemented: refused)")
    expert_parallel: PositiveInt = Field(1, description="expert-parallel size (> 1 not implemented: refused)")
    gpus: GpuRoles | None = Field(None, description="GPUs per GRPO role; null: roles not placed")
    rollout_replicas: PositiveInt = Field(1, description="GRPO rollout engine replicas")
    meta_init: Flag = Field(True, description="FSDP2 runs: rank 0 loads the base model, the other ranks build it "
                                              "with parameters on the meta device and receive only their shards; "
                                              "false: every rank loads the whole model first")

    @property
    def policy_gpus(self) -> int:
        return self.gpus.policy if self.gpus else 1

    @property
    def rollout_gpus(self) -> int:
        return self.gpus.rollout if self.gpus else 1

    @property
    def roles_given(self) -> bool:
        """Whether the recipe places GRPO's roles (GPUs per role, or more than one rollout replica)."""
        return self.gpus is not None or self.rollout_replicas > 1


# -- the whole file ------------------------------------------------------------------------------------------

StagesConfig = create_model(
    "StagesConfig",
    __base__=Strict,
    __doc__="The stages this recipe declares, each with its typed options (an absent stage is not run).",
    **{name: (cls | None, Field(None, description=(cls.__doc__ or "").strip()))  # type: ignore[misc]
       for name, cls in STAGE_OPTIONS.items()},
)


class RecipeFile(Strict):
    """The schema of a recipe YAML file."""

    name: Annotated[Text, Field(min_length=1)] = Field(description="recipe name (default run directory runs/<name>)")
    model: ModelField = Field(description="a registered model name (see `stitch models`), or {name, snapshot, "
                                          "backend} to read it from a local snapshot directory and/or load it "
                                          "through another implementation")
    encoder: Annotated[Text, Field(min_length=1)] = Field(description="a registered encoder (see `stitch encoders`)")
    projector: Text = Field("mlp2x_gelu", description="a registered projector (see `stitch registry projectors`)")
    task: TaskField = Field(
        default_factory=lambda: TaskConfig(name=DEFAULT_TASK),
        description=f"a registered task name, {{name: ...}}, or {{reward: 'module:function', grade: ...}}; "
                    f"default {DEFAULT_TASK}",
    )
    data: DataConfig = Field(description="the dataset and its preparation")
    parallel: ParallelConfig | None = Field(None, description="launch layout; null: one process")
    stages: StagesConfig = Field(default_factory=StagesConfig, description="stage name -> options")  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _stages_fit_together(self) -> RecipeFile:
        stages = declared_stages(self.stages)
        partitions = [p.name for p in self.data.partitions]
        for stage, opts in stages.items():
            for key in ("partition", "eval_partition"):
                value = getattr(opts, key, None)
                if value is not None and value not in partitions:
                    raise field_error(f"stages.{stage}.{key}",
                                      f"one of the data partitions {', '.join(partitions)}", value)
        for stage in ("grpo", "dpo"):
            if stage in stages and "sft" not in stages:
                raise field_error(f"stages.{stage}", f"a recipe that also declares 'sft' ({stage} warm-starts from "
                                                     f"SFT's adapter and projector)", sorted(stages))
            lora = getattr(stages.get(stage), "lora", None)
            if lora is not None and "sft" in stages:
                for key in ("r", "alpha"):
                    want, got = getattr(stages["sft"].lora, key), getattr(lora, key)
                    if want != got:
                        raise field_error(f"stages.{stage}.lora.{key}",
                                          f"{want} (the warm start restates SFT's adapter)", got)
        return self


def declared_stages(stages: BaseModel) -> dict[str, StageOptions]:
    """The stages a validated ``stages`` section declares, in ``STAGE_OPTIONS`` order."""
    return {name: getattr(stages, name) for name in STAGE_OPTIONS if getattr(stages, name) is not None}


# -- the resolved recipe -------------------------------------------------------------------------------------


@plain_dataclass(frozen=True)
class Recipe:
    """A validated recipe: its parts, the stages it declares (name -> typed options) and where it came from."""

    name: str
    model: str
    encoder: str
    projector: str
    data: DataConfig
    stages: dict[str, StageOptions] = plain_field(default_factory=dict)
    path: Path | None = None
    parallel: ParallelConfig | None = None
    task: TaskConfig = plain_field(default_factory=lambda: TaskConfig(name=DEFAULT_TASK))
    model_snapshot: Path | None = None  # read the model from this local snapshot instead of its hub source
    model_backend: str = "transformers"  # the LM implementation (ModelSpec.backends)

    def stage_options(self, name: str) -> StageOptions:
        """The typed options of a stage this recipe declares; RecipeError naming the stage otherwise."""
        if name not in self.stages:
            raise RecipeError(f"{self.where()}: no stage {name!r} under 'stages'; it declares "
                              f"{', '.join(self.stages) or 'none'}")
        return self.stages[name]

    def stage(self, name: str) -> dict[str, Any]:
        """The options the recipe sets for a stage, as a plain mapping (the ones left at their default omitted)."""
        return self.stage_options(name).model_dump(exclude_unset=True)

    def resolved(self) -> dict[str, Any]:
        """Every field of the recipe after overrides and defaults, as plain YAML-able data."""
        return {
            "name": self.name,
            "model": self.model if self.model_snapshot is None and self.model_backend == "transformers" else {
                "name": self.model,
                **({} if self.model_snapshot is None else {"snapshot": str(self.model_snapshot)}),
                **({} if self.model_backend == "transformers" else {"backend": self.model_backend})},
            "encoder": self.encoder,
            "projector": self.projector,
            "task": self.task.name if self.task.reward is None else _adapter(TaskConfig).dump_python(
                self.task, mode="json", exclude_none=True),
            "data": _adapter(DataConfig).dump_python(self.data, mode="json"),
            "parallel": None if self.parallel is None else _adapter(ParallelConfig).dump_python(self.parallel,
                                                                                                mode="json"),
            "stages": {name: opts.model_dump(mode="json") for name, opts in self.stages.items()},
        }

    def resolved_yaml(self) -> str:
        """The resolved recipe as canonical YAML (what the digest hashes and a run directory keeps)."""
        return yaml.dump(self.resolved(), Dumper=_CanonicalDumper, sort_keys=False, width=100, allow_unicode=True)

    @property
    def digest(self) -> str:
        """sha256 of ``resolved_yaml()``: equal for recipes that resolve alike, whatever their YAML spelling."""
        return hashlib.sha256(self.resolved_yaml().encode()).hexdigest()

    def where(self) -> str:
        """How errors name this recipe: its file, or its name when it was parsed from a mapping."""
        return f"recipe {str(self.path) if self.path else self.name!r}"


class _CanonicalDumper(yaml.SafeDumper):
    """Block mappings; short lists of scalars (partition bounds) in flow style."""


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    flow = all(isinstance(v, int | float | str | bool) or v is None for v in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_CanonicalDumper.add_representer(list, _represent_list)


@cache
def _adapter(cls: type) -> TypeAdapter[Any]:
    return TypeAdapter(cls)


# -- parsing -------------------------------------------------------------------------------------------------


def parse_recipe(mapping: Any, *, path: Path | None = None, overrides: Iterable[str] = ()) -> Recipe:
    """A Recipe from an already-loaded YAML mapping; ``path`` locates relative data paths and names errors;
    ``overrides`` (``key=value``) apply to the mapping first."""
    where = _where(path, mapping)
    overrides = tuple(overrides)
    if overrides:
        mapping = apply_overrides(mapping, overrides, where)
    try:
        checked = RecipeFile.model_validate(mapping, context={"base_dir": path.parent if path else None})
    except ValidationError as exc:
        raise RecipeError(format_validation_error(exc, RecipeFile, where, overrides)) from None
    return Recipe(
        name=checked.name,
        model=checked.model.name,
        model_snapshot=checked.model.snapshot,
        model_backend=checked.model.backend,
        encoder=checked.encoder,
        projector=checked.projector,
        data=checked.data,
        stages=declared_stages(checked.stages),
        path=path,
        parallel=checked.parallel,
        task=checked.task,
    )


def load_recipe(name_or_path: str | Path, registry: Registry | None = None, *,
                overrides: Iterable[str] = ()) -> Recipe:
    """A recipe by YAML file path, or by a name registered in ``registry`` (``register_recipes``; the CLI passes the
    plugin host), with ``key=value`` overrides (``stages.sft.steps=50``; values parse as YAML, so ``lora={r: 8}``
    and ``1e-4`` work)."""
    candidate = Path(name_or_path)
    if candidate.suffix in {".yaml", ".yml"} or candidate.is_file():
        if not candidate.is_file():
            raise RecipeError(f"recipe file {str(candidate)!r} does not exist")
        path = candidate.resolve()
    elif registry is None:
        raise RecipeError(f"recipe {str(name_or_path)!r} is not a file; a registered recipe name needs the "
                          f"registry of recipes (load_recipe(name, host))")
    else:
        path = Path(registry.get("recipes", str(name_or_path)).path)
    mapping = read_yaml_file(path)  # UTF-8 only; a key given twice is refused with both lines
    return parse_recipe(mapping, path=path, overrides=overrides)


def apply_overrides(mapping: Any, overrides: Iterable[str], where: str = "recipe") -> dict[str, Any]:
    """A copy of ``mapping`` with each ``dotted.key=value`` set (missing parent mappings are created; the
    schema then refuses a key that does not exist, naming its path)."""
    if not isinstance(mapping, Mapping):
        raise RecipeError(f"{where}: expected a mapping at the top of the file, got {short_repr(mapping)}")
    result = _copy_mapping(mapping)
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise RecipeError(f"{where}: override {item!r}: expected dotted.key=value, e.g. stages.sft.steps=50")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise RecipeError(f"{where}: override {item!r}: the value is not valid YAML: {exc}") from None
        node = result
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                prefix = ".".join(parts[: depth + 1])
                raise RecipeError(f"{where}: override {item!r}: field {prefix!r} holds {short_repr(child)}, not a "
                                  f"mapping, so it has no field {parts[depth + 1]!r}")
            node = child
        node[parts[-1]] = value
    return result


def _copy_mapping(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _copy_mapping(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_mapping(v) for v in value]
    return value


def _where(path: Path | None, mapping: Any) -> str:
    if path is not None:
        return f"recipe {str(path)!r}"
    name = mapping.get("name") if isinstance(mapping, Mapping) else None
    return f"recipe {name!r}" if isinstance(name, str) else "recipe"


# -- schema ----------------------------------------------------------------------------------------------------


def recipe_json_schema() -> dict[str, Any]:
    """The JSON schema of a recipe file (what `stitch recipe schema` prints)."""
    return RecipeFile.model_json_schema()



def shipped_recipes(directory: Path) -> list[RecipeSpec]:
    """A ``RecipeSpec`` for every ``*.yaml`` in ``directory`` (a plugin's recipes), described by the file's
    first comment line."""
    return [
        RecipeSpec(path.stem, path, path.read_text().splitlines()[0].lstrip("# "))
        for path in sorted(Path(directory).glob("*.yaml"))
    ]
