"""Recipes: one YAML file per run, parsed into frozen dataclasses; every error names the field at fault.

``stages`` stays a free mapping per stage: the training code validates its own stage options.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

FEATURE_DTYPES = ("float16", "bfloat16", "float32")
SOURCE_FORMATS = ("parquet", "json", "imagefolder")
BUILTIN_DATASETS = ("counting-shapes", "shape-colors")
ON_CORRUPT = ("error", "skip")
_SHA = re.compile(r"^[0-9a-f]{40}$")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


class RecipeError(ValueError):
    """A recipe is malformed; the message names the file, the field, what was expected and what was found."""


@dataclass(frozen=True)
class BuiltinSource:
    """A dataset stitch generates itself (the demo), written to disk and read like user data."""

    builtin: str
    rows: int
    caption_rows: int = 0
    seed: int = 0

    def describe(self) -> str:
        return f"builtin:{self.builtin}(rows={self.rows},caption_rows={self.caption_rows},seed={self.seed})"


@dataclass(frozen=True)
class LocalSource:
    """A local file or directory read through a ``datasets`` packaged builder."""

    path: Path  # absolute: relative paths are resolved against the recipe file's directory
    format: str
    split: str = "train"

    def describe(self) -> str:
        return f"{self.format}:{self.path}"


@dataclass(frozen=True)
class HubSource:
    """A hub dataset pinned to a commit."""

    hub: str
    revision: str
    config: str | None = None
    split: str = "train"

    def describe(self) -> str:
        config = f"/{self.config}" if self.config else ""
        return f"hub:{self.hub}{config}@{self.revision}[{self.split}]"


DataSource = BuiltinSource | LocalSource | HubSource


@dataclass(frozen=True)
class ColumnMapping:
    """Which dataset columns hold the media, the text (question + answer, or chat messages) and the row id."""

    media: str
    question: str | None = None
    answer: str | None = None
    messages: str | None = None
    id: str | None = None  # without it, a row's id is its stream position: "row<N>"
    rejected: str | None = None  # a dispreferred answer per row, kept for DPO pairs (ManifestRow.extra)

    @property
    def text_columns(self) -> tuple[str, ...]:
        if self.messages is not None:
            return (self.messages,)
        return (self.question, self.answer)  # type: ignore[return-value]


@dataclass(frozen=True)
class Partition:
    """Valid-row ordinals ``[start, end)`` that make up one named slice of the prepared data."""

    name: str
    start: int
    end: int

    def __contains__(self, ordinal: int) -> bool:
        return self.start <= ordinal < self.end

    @property
    def rows(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Budgets:
    transient_mib: float
    retained_mib: float

    @property
    def transient_bytes(self) -> int:
        return int(self.transient_mib * 2**20)

    @property
    def retained_bytes(self) -> int:
        return int(self.retained_mib * 2**20)


@dataclass(frozen=True)
class DataConfig:
    source: DataSource
    columns: ColumnMapping
    partitions: tuple[Partition, ...]
    scan_cap: int
    budgets: Budgets
    on_corrupt: str = "error"
    feature_dtype: str = "float32"
    encode_batch_size: int = 32
    shard_rows: int = 256

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


@dataclass(frozen=True)
class ParallelConfig:
    """How a recipe expects to be launched; ``stitch.config.validate`` checks the arithmetic before anything runs.

    Unset sizes resolve at launch: ``world_size`` from torchrun's WORLD_SIZE, ``data_parallel`` to
    ``world_size / tensor_parallel``. ``gpus`` + ``rollout_replicas`` place GRPO's roles.
    """

    world_size: int | None = None
    data_parallel: int | None = None
    tensor_parallel: int = 1
    expert_parallel: int = 1
    policy_gpus: int = 1
    rollout_gpus: int = 1
    rollout_replicas: int = 1
    roles_given: bool = False  # whether the recipe placed GRPO's roles (``gpus`` / ``rollout_replicas``)


@dataclass(frozen=True)
class TaskConfig:
    """What the recipe is trained and judged on: a registered task ``name``, or a ``reward`` (and optional
    ``grade``) given as ``module:function`` or ``path/to/file.py:function`` (relative to the recipe file)."""

    name: str | None = None
    reward: str | None = None
    grade: str | None = None


@dataclass(frozen=True)
class Recipe:
    name: str
    model: str
    encoder: str
    projector: str
    data: DataConfig
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)
    path: Path | None = None
    digest: str = ""  # sha256 of the YAML text, for provenance
    parallel: ParallelConfig | None = None
    task: TaskConfig | None = None

    def stage(self, name: str) -> dict[str, Any]:
        if name not in self.stages:
            raise RecipeError(f"{self._where()}: no stage {name!r} under 'stages'; it has {sorted(self.stages)}")
        return copy.deepcopy(self.stages[name])

    def _where(self) -> str:
        return f"recipe {str(self.path) if self.path else self.name!r}"


# -- parsing -------------------------------------------------------------------------------------------


class _Fields:
    """Typed reads of one mapping in the YAML, each error naming the dotted field path."""

    def __init__(self, where: str, prefix: str, mapping: Any) -> None:
        self.where = where
        self.prefix = prefix
        if not isinstance(mapping, Mapping):
            self.fail("", "a mapping", mapping)
        self.mapping: Mapping[str, Any] = mapping
        self.seen: set[str] = set()

    def path(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix and key else (self.prefix or key)

    def fail(self, key: str, expected: str, actual: Any) -> None:
        raise RecipeError(f"{self.where}: field {self.path(key)!r}: expected {expected}, got {actual!r}")

    def get(self, key: str, kind: type | tuple[type, ...], expected: str, default: Any = ...) -> Any:
        self.seen.add(key)
        if key not in self.mapping or self.mapping[key] is None:
            if default is ...:
                raise RecipeError(f"{self.where}: field {self.path(key)!r} is missing; expected {expected}")
            return default
        value = self.mapping[key]
        # bool is an int in Python; a YAML `yes` is never a row count
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
            self.fail(key, expected, value)
        return value

    def sub(self, key: str, default: Any = ...) -> _Fields:
        value = self.get(key, Mapping, "a mapping", default)
        return _Fields(self.where, self.path(key), value)

    def positive_int(self, key: str, default: Any = ...) -> int:
        value = self.get(key, int, "a positive integer", default)
        if value is not None and value < 1:
            self.fail(key, "a positive integer", value)
        return value

    def choice(self, key: str, options: tuple[str, ...], default: Any = ...) -> str:
        expected = "one of " + ", ".join(options)
        value = self.get(key, str, expected, default)
        if value not in options:
            self.fail(key, expected, value)
        return value

    def done(self) -> None:
        unknown = sorted(set(self.mapping) - self.seen)
        if unknown:
            known = ", ".join(sorted(self.seen))
            raise RecipeError(
                f"{self.where}: unknown field {self.path(str(unknown[0]))!r}; known fields here: {known}"
            )


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _parse_source(fields: _Fields, base_dir: Path | None) -> DataSource:
    keys = [k for k in ("builtin", "path", "hub") if k in fields.mapping]
    if len(keys) != 1:
        fields.fail("", "exactly one of 'builtin', 'path' or 'hub'", dict(fields.mapping))
    kind = keys[0]
    if kind == "builtin":
        source: DataSource = BuiltinSource(
            builtin=fields.choice("builtin", BUILTIN_DATASETS),
            rows=fields.positive_int("rows"),
            caption_rows=fields.get("caption_rows", int, "a non-negative integer", 0),
            seed=fields.get("seed", int, "an integer", 0),
        )
        if not 0 <= source.caption_rows <= source.rows:
            fields.fail("caption_rows", f"an integer in [0, rows={source.rows}]", source.caption_rows)
    elif kind == "path":
        raw = Path(fields.get("path", str, "a file or directory path"))
        if not raw.is_absolute():
            raw = (base_dir or Path.cwd()) / raw
        source = LocalSource(
            path=raw.resolve(),
            format=fields.choice("format", SOURCE_FORMATS),
            split=fields.get("split", str, "a split name", "train"),
        )
    else:
        source = HubSource(
            hub=fields.get("hub", str, "a hub dataset id such as 'org/name'"),
            revision=fields.get("revision", str, "a pinned 40-hex commit sha"),
            config=fields.get("config", str, "a configuration name", None),
            split=fields.get("split", str, "a split name", "train"),
        )
        if not _SHA.match(source.revision):
            fields.fail("revision", "a pinned 40-hex commit sha (branches and tags move)", source.revision)
        if "/" not in source.hub:
            fields.fail("hub", "a hub dataset id such as 'org/name'", source.hub)
    fields.done()
    return source


def _parse_columns(fields: _Fields) -> ColumnMapping:
    text = "a column name"
    columns = ColumnMapping(
        media=fields.get("media", str, text),
        question=fields.get("question", str, text, None),
        answer=fields.get("answer", str, text, None),
        messages=fields.get("messages", str, text, None),
        id=fields.get("id", str, text, None),
        rejected=fields.get("rejected", str, text, None),
    )
    fields.done()
    has_qa = columns.question is not None or columns.answer is not None
    if columns.messages is not None and has_qa:
        fields.fail("messages", "either 'messages' or 'question' + 'answer', not both", dict(fields.mapping))
    if columns.messages is None and (columns.question is None or columns.answer is None):
        missing = "question" if columns.question is None else "answer"
        raise RecipeError(
            f"{fields.where}: field {fields.path(missing)!r} is missing; expected a column name "
            f"(or map 'messages' to a chat-messages column instead of question + answer)"
        )
    return columns


def _parse_partitions(fields: _Fields) -> tuple[Partition, ...]:
    parts = []
    for name, value in fields.mapping.items():
        fields.seen.add(name)
        if not isinstance(name, str) or not _NAME.match(name):
            fields.fail(str(name), "a partition name (letters, digits, _ . -)", name)
        ok = (
            isinstance(value, list | tuple)
            and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            and 0 <= value[0] < value[1]
        )
        if not ok:
            fields.fail(name, "[start, end) valid-row ordinals with 0 <= start < end", value)
        parts.append(Partition(name, value[0], value[1]))
    if not parts:
        fields.fail("", "at least one partition, e.g. {sft: [0, 320]}", dict(fields.mapping))
    parts.sort(key=lambda p: p.start)
    for before, after in zip(parts, parts[1:], strict=False):
        if after.start < before.end:
            raise RecipeError(
                f"{fields.where}: field {fields.prefix!r}: partitions {before.name!r} [{before.start}, "
                f"{before.end}) and {after.name!r} [{after.start}, {after.end}) overlap; a valid row belongs "
                f"to at most one partition"
            )
    return tuple(parts)


def _parse_data(fields: _Fields, base_dir: Path | None) -> DataConfig:
    source = _parse_source(fields.sub("source"), base_dir)
    columns = _parse_columns(fields.sub("columns"))
    partitions = _parse_partitions(fields.sub("partitions"))
    budget_fields = fields.sub("budgets")
    budgets = Budgets(
        transient_mib=budget_fields.get("transient_mib", (int, float), "a size in MiB"),
        retained_mib=budget_fields.get("retained_mib", (int, float), "a size in MiB"),
    )
    for key in ("transient_mib", "retained_mib"):
        if getattr(budgets, key) <= 0:
            budget_fields.fail(key, "a positive size in MiB", getattr(budgets, key))
    budget_fields.done()
    data = DataConfig(
        source=source,
        columns=columns,
        partitions=partitions,
        scan_cap=fields.positive_int("scan_cap"),
        budgets=budgets,
        on_corrupt=fields.choice("on_corrupt", ON_CORRUPT, "error"),
        feature_dtype=fields.choice("feature_dtype", FEATURE_DTYPES, "float32"),
        encode_batch_size=fields.positive_int("encode_batch_size", 32),
        shard_rows=fields.positive_int("shard_rows", 256),
    )
    fields.done()
    if data.scan_cap < data.rows_needed:
        fields.fail(
            "scan_cap",
            f"at least {data.rows_needed} (partitions end at valid row {data.rows_needed})",
            data.scan_cap,
        )
    if isinstance(source, BuiltinSource) and source.rows < data.rows_needed:
        raise RecipeError(
            f"{fields.where}: field 'data.source.rows': expected at least {data.rows_needed} "
            f"(partitions end at valid row {data.rows_needed}), got {source.rows}"
        )
    return data


def parse_recipe(mapping: Any, *, path: Path | None = None, text: str = "") -> Recipe:
    """A Recipe from an already-loaded YAML mapping; ``path`` locates relative data paths and names errors."""
    where = f"recipe {str(path)!r}" if path else "recipe"
    top = _Fields(where, "", mapping)
    name = top.get("name", str, "a recipe name")
    recipe = Recipe(
        name=name,
        model=top.get("model", str, "a registered model name (see `stitch models`)"),
        encoder=top.get("encoder", str, "a registered encoder name (see `stitch encoders`)"),
        projector=top.get("projector", str, "a registered projector name", "mlp2x_gelu"),
        data=_parse_data(top.sub("data"), path.parent if path else None),
        stages=_parse_stages(top.sub("stages", {})),
        path=path,
        digest=hashlib.sha256(text.encode()).hexdigest() if text else "",
        parallel=_parse_parallel(top.sub("parallel")) if top.mapping.get("parallel") is not None else None,
    )
    top.seen.add("parallel")
    recipe = dataclasses.replace(recipe, task=_parse_task(top))
    top.done()
    return recipe


def _parse_task(top: _Fields) -> TaskConfig | None:
    value = top.get("task", (str, Mapping), "a registered task name or {name | reward, grade}", None)
    if value is None or isinstance(value, str):
        return None if value is None else TaskConfig(name=value)
    fields = _Fields(top.where, "task", value)
    text = "'module:function' or 'path/to/file.py:function'"
    task = TaskConfig(name=fields.get("name", str, "a registered task name", None),
                      reward=fields.get("reward", str, text, None), grade=fields.get("grade", str, text, None))
    fields.done()
    if (task.name is None) == (task.reward is None):
        fields.fail("", "exactly one of 'name' or 'reward'", dict(value))
    return task


def _parse_parallel(fields: _Fields) -> ParallelConfig:
    """Types only; the cross-field arithmetic lives in ``stitch.config.validate.check_parallel``."""
    roles = fields.sub("gpus") if fields.mapping.get("gpus") is not None else None
    config = ParallelConfig(
        world_size=fields.positive_int("world_size", None),
        data_parallel=fields.positive_int("data_parallel", None),
        tensor_parallel=fields.positive_int("tensor_parallel", 1),
        expert_parallel=fields.positive_int("expert_parallel", 1),
        policy_gpus=roles.positive_int("policy", 1) if roles else 1,
        rollout_gpus=roles.positive_int("rollout", 1) if roles else 1,
        rollout_replicas=fields.positive_int("rollout_replicas", 1),
        roles_given=roles is not None or fields.mapping.get("rollout_replicas") is not None,
    )
    fields.seen.add("gpus")
    if roles:
        roles.done()
    fields.done()
    return config


def _parse_stages(fields: _Fields) -> dict[str, dict[str, Any]]:
    stages = {}
    for stage, options in fields.mapping.items():
        fields.seen.add(stage)
        if not isinstance(options, Mapping):
            fields.fail(str(stage), "a mapping of stage options", options)
        stages[str(stage)] = copy.deepcopy(dict(options))
    return stages


def load_recipe(name_or_path: str | Path, host: Any = None) -> Recipe:
    """A recipe by registered name (``register_recipes``) or by YAML file path."""
    candidate = Path(name_or_path)
    if candidate.suffix in {".yaml", ".yml"} or candidate.is_file():
        if not candidate.is_file():
            raise RecipeError(f"recipe file {str(candidate)!r} does not exist")
        path = candidate.resolve()
    else:
        if host is None:
            from stitch.plugins.host import get_host

            host = get_host()
        path = Path(host.get("recipes", str(name_or_path)).path)
    text = path.read_text()
    try:
        mapping = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RecipeError(f"recipe {str(path)!r} is not valid YAML: {exc}") from exc
    return parse_recipe(mapping, path=path, text=text)


def stage_options(cls: type, recipe: Recipe, stage: str) -> Any:
    """``cls(**recipe.stages[stage])`` for a dataclass of stage options; an unknown key is refused by name."""
    raw = recipe.stage(stage)
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise RecipeError(
            f"recipe {recipe.name!r}: unknown field 'stages.{stage}.{unknown[0]}'; known: {', '.join(sorted(known))}"
        )
    return cls(**raw)


def shipped_recipes(directory: Path) -> list[Any]:
    """A ``RecipeSpec`` for every ``*.yaml`` in ``directory`` (a plugin's recipes), described by the file's
    first comment line."""
    from stitch.plugins.specs import RecipeSpec

    return [
        RecipeSpec(path.stem, path, path.read_text().splitlines()[0].lstrip("# "))
        for path in sorted(Path(directory).glob("*.yaml"))
    ]
