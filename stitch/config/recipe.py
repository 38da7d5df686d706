"""Recipes: one YAML file per run, validated by one pydantic schema (``RecipeFile``) into a frozen ``Recipe``.

``key=value`` overrides apply to the YAML mapping before validation; every refusal is one ``RecipeError`` naming
the file, the dotted field path, what was expected and what was found. The digest hashes the resolved recipe.
The schema's parts live in ``stitch.config.schema`` (the file) and ``stitch.config.data`` (its data section).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from stitch.config.data import (
    BuiltinSource,
    DataConfig,
    DatasetConfig,
    DataSource,
    HubSource,
    LocalSource,
    Partition,
    complete_datasets,
)
from stitch.config.describe import format_validation_error, short_repr
from stitch.config.options import StageOptions
from stitch.config.schema import DEFAULT_TASK, ParallelConfig, RecipeFile, TaskConfig, declared_stages
from stitch.config.yaml_io import read_yaml_file
from stitch.plugins.registry import Registry
from stitch.plugins.specs import RecipeSpec

# the schema's names that code loading recipes reads, importable from here too
__all__ = [
    "BuiltinSource", "DataConfig", "DataSource", "HubSource", "LocalSource", "ParallelConfig", "Recipe",
    "RecipeError", "RecipeFile", "TaskConfig", "apply_overrides", "load_recipe", "parse_recipe",
    "recipe_json_schema", "shipped_recipes",
]


class RecipeError(ValueError):
    """A recipe is malformed; the message names the file, the field, what was expected and what was found."""


# -- the resolved recipe -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recipe:
    """A validated recipe: its parts, the stages it declares (name -> typed options) and where it came from."""

    name: str
    model: str
    encoder: str
    projector: str
    data: DataConfig
    stages: dict[str, StageOptions] = field(default_factory=dict)
    path: Path | None = None
    parallel: ParallelConfig | None = None
    task: TaskConfig = field(default_factory=lambda: TaskConfig(name=DEFAULT_TASK))
    model_snapshot: Path | None = None  # read the model from this local snapshot instead of its hub source
    model_backend: str = "transformers"  # the LM implementation (ModelSpec.backends)
    dataset_options: dict[str, DatasetConfig] | None = None  # the recipe's ``datasets``, as written

    @property
    def datasets(self) -> dict[str, DataConfig]:
        """Each dataset as a complete single-source config with its partitions' stage-facing names, in recipe
        order; a recipe with one ``data.source`` has one, named ``data``."""
        return complete_datasets(self.data, self.dataset_options)

    @property
    def partitions(self) -> tuple[Partition, ...]:
        """Every partition of every dataset: the names stages train on and are graded on."""
        return tuple(p for data in self.datasets.values() for p in data.partitions or ())

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
            **({} if self.dataset_options is None else {"datasets": {
                name: _adapter(DatasetConfig).dump_python(ds, mode="json")
                for name, ds in self.dataset_options.items()}}),
            "parallel": None if self.parallel is None else _adapter(ParallelConfig).dump_python(self.parallel,
                                                                                                mode="json"),
            # a stage's data mixture stands for its partition: the one the stage reads is dumped
            "stages": {name: opts.model_dump(mode="json", exclude={"partition"} if opts.data is not None else None)
                       for name, opts in self.stages.items()},
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
        dataset_options=checked.datasets,
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
