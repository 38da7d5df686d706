"""The schema of a recipe file (``RecipeFile``): the base model, the task, the parallel layout, the data section
(``stitch.config.data``) and the stages (``stitch.config.options``), with the checks that tie stages together."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass

from stitch.config.data import DATASET_NAME, DataConfig, DatasetConfig, complete_datasets
from stitch.config.describe import field_error
from stitch.config.options import (
    STAGE_OPTIONS,
    STRICT_DATACLASS,
    Flag,
    PositiveInt,
    StageOptions,
    Strict,
    Text,
)

DEFAULT_TASK = "exact-match"  # a recipe that names no task is graded by normalised exact match of the answer
_CALLABLE = re.compile(r"^.+:[A-Za-z_][A-Za-z0-9_]*$")


# -- the base model ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, config=STRICT_DATACLASS)
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


# -- task and parallel layout ------------------------------------------------------------------------------


def _task_from_name(value: Any) -> Any:
    """`task: counting` is short for `task: {name: counting}`."""
    return {"name": value} if isinstance(value, str) else value


@dataclass(frozen=True, config=STRICT_DATACLASS)
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


@dataclass(frozen=True, config=STRICT_DATACLASS)
class GpuRoles:
    """GPUs per GRPO role."""

    policy: PositiveInt = Field(1, description="GPUs of the trained policy")
    rollout: PositiveInt = Field(1, description="GPUs of each rollout replica")


@dataclass(frozen=True, config=STRICT_DATACLASS)
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
    data: DataConfig = Field(description="the dataset and its preparation; with datasets, only the preparation "
                                         "fields every dataset shares")
    datasets: dict[Text, DatasetConfig] | None = Field(
        None, description="named datasets (instead of data.source), each with its own source, columns, rows and "
                          "row checks, prepared into one feature cache; stages name them in data")
    parallel: ParallelConfig | None = Field(None, description="launch layout; null: one process")
    stages: StagesConfig = Field(default_factory=StagesConfig, description="stage name -> options")  # type: ignore[valid-type]

    @model_validator(mode="before")
    @classmethod
    def _source_or_datasets(cls, value: Any) -> Any:
        """A source under data beside datasets is refused before data's own checks ask for its columns."""
        data = value.get("data") if isinstance(value, dict) else None
        if isinstance(data, dict) and data.get("source") is not None and value.get("datasets") is not None:
            raise field_error("data.source", "null in a recipe that declares datasets (move it to "
                                             "datasets.<name>.source)", data["source"])
        return value

    @model_validator(mode="after")
    def _one_data_source(self) -> RecipeFile:
        if self.datasets is None and self.data.source is None:
            raise field_error("data.source", "a data source (builtin / path / hub), or named datasets under "
                                             "'datasets'")
        if self.datasets is not None:
            if self.data.source is not None:
                raise field_error("data.source", "null in a recipe that declares datasets (move it to "
                                                 "datasets.<name>.source)", self.data.source.describe())
            if not self.datasets:
                raise field_error("datasets", "at least one dataset, e.g. {captions: {source: ..., columns: ..., "
                                              "rows: 1000}}", {})
            for name in self.datasets:
                if not DATASET_NAME.match(name):
                    raise field_error(f"datasets.{name}", "a dataset name (letters, digits, _ -; no '.')", name)
        return self

    @model_validator(mode="after")
    def _stages_fit_together(self) -> RecipeFile:
        stages = declared_stages(self.stages)
        partitions = [p.name for data in complete_datasets(self.data, self.datasets).values() for p in data.partitions or ()]
        named = "the datasets' partitions" if self.datasets is not None else "the data partitions"
        for stage, opts in stages.items():
            if self.datasets is not None and "partition" in opts.model_fields_set:
                raise field_error(f"stages.{stage}.partition", f"unset in a recipe with datasets: name what the "
                                  f"stage trains on in stages.{stage}.data (one of {', '.join(partitions)}, or "
                                  f"{{name: weight}})", opts.partition)
            if self.datasets is not None and opts.data is None:
                raise field_error(f"stages.{stage}.data", f"one of {named} {', '.join(partitions)}, or a "
                                                          f"mixture {{name: weight}}")
            for name in opts.data or ():
                if name not in partitions:
                    raise field_error(f"stages.{stage}.data.{name}", f"one of {named} {', '.join(partitions)}",
                                      name)
            for key in ("partition", "eval_partition"):
                value = getattr(opts, key, None)
                if key == "partition" and opts.data is not None:
                    continue
                if value is not None and value not in partitions:
                    raise field_error(f"stages.{stage}.{key}",
                                      f"one of {named} {', '.join(partitions)}", value)
        for stage in ("grpo", "dpo"):
            if stage in stages and "sft" not in stages:
                raise field_error(f"stages.{stage}", f"a recipe that also declares 'sft' ({stage} warm-starts from "
                                                     f"SFT's adapter and projector)", sorted(stages))
            if stage in stages and stages["sft"].train_lm != "lora":
                raise field_error("stages.sft.train_lm",
                                  f"lora while the recipe declares {stage} ({stage} warm-starts from SFT's adapter; a "
                                  f"fully fine-tuned SFT LM is served and exported, not warm-started from yet)",
                                  stages["sft"].train_lm)
            lora = getattr(stages.get(stage), "lora", None)
            if lora is not None and "sft" in stages:
                for key in ("r", "alpha"):
                    want, got = getattr(stages["sft"].lora, key), getattr(lora, key)
                    if want != got:
                        raise field_error(f"stages.{stage}.lora.{key}",
                                          f"{want} (the warm start restates SFT's adapter)", got)
        donor = getattr(stages.get("dpo"), "warm_start", None)
        if donor is not None and donor not in stages:
            raise field_error("stages.dpo.warm_start", f"a stage the recipe declares ({', '.join(stages)})", donor)
        return self


def declared_stages(stages: BaseModel) -> dict[str, StageOptions]:
    """The stages a validated ``stages`` section declares, in ``STAGE_OPTIONS`` order."""
    return {name: getattr(stages, name) for name in STAGE_OPTIONS if getattr(stages, name) is not None}
