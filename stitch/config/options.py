"""Typed options of every stage (pydantic v2): coerced (YAML's ``1e-4`` string is a float), range-checked, and
unknown keys refused at every depth. ``STAGE_OPTIONS`` maps a stage name to its options class.

Every option here is honoured by the stage that reads it; a stage that cannot honour a shared option does not
declare it, so a recipe that sets it is refused at load, naming the field.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from annotated_types import Ge, Gt, Lt
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic import Strict as StrictValue

from stitch.config.describe import field_error

# -- value types shared by the whole recipe schema --------------------------------------------------------
# Integers and booleans are strict: YAML already types them, and a `yes` or `2.5` where a count belongs is a
# mistake, not something to round. Numbers also accept the text PyYAML leaves for `1e-4` (no dot: a str).


def _number_text(value: Any) -> Any:
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        return number if math.isfinite(number) else value
    return value


Int = Annotated[int, StrictValue()]
PositiveInt = Annotated[int, StrictValue(), Gt(0)]
NonNegativeInt = Annotated[int, StrictValue(), Ge(0)]
# the text-to-number step goes last so that the bounds stay JSON-schema keywords (exclusiveMinimum, ...)
Number = Annotated[float, StrictValue(), BeforeValidator(_number_text)]
PositiveNumber = Annotated[float, StrictValue(), Gt(0), BeforeValidator(_number_text)]
NonNegativeNumber = Annotated[float, StrictValue(), Ge(0), BeforeValidator(_number_text)]
Probability = Annotated[float, StrictValue(), Ge(0), Lt(1), BeforeValidator(_number_text)]
Flag = Annotated[bool, StrictValue()]
Text = Annotated[str, StrictValue()]

def _layer_entry(value: Any) -> Any:
    """One ``train_lm_layers`` entry: refused here, in words, rather than as two failed union members."""
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    raise field_error("", "a decoder-layer index (an integer from 0) or a parameter-name pattern (text)", value)


LayerEntry = Annotated[NonNegativeInt | Text, BeforeValidator(_layer_entry)]


def _mixture(value: Any) -> Any:
    """A stage's ``data``: one partition name is short for ``{name: 1}``."""
    if isinstance(value, str):
        return {value: 1.0}
    if isinstance(value, dict) and not value:
        raise field_error("", "a partition name or a non-empty mapping {partition: weight}", value)
    if isinstance(value, dict):
        for name, weight in value.items():
            number = _number_text(weight)
            if isinstance(number, bool) or not isinstance(number, int | float) or not 0 < number < math.inf:
                raise field_error(str(name), "a positive number (the partition's weight in the mixture)", weight)
    return value


Mixture = Annotated[dict[Text, PositiveNumber], BeforeValidator(_mixture, json_schema_input_type=str | dict[str, float])]

STRICT_CONFIG = ConfigDict(extra="forbid", frozen=True)
STRICT_DATACLASS = ConfigDict(extra="forbid")  # the same for pydantic dataclasses (frozen by their decorator)


class Strict(BaseModel):
    """A recipe mapping: unknown keys are errors, instances are immutable."""

    model_config = STRICT_CONFIG


class LoraOptions(Strict):
    """The LoRA adapter trained in SFT (and restated by GRPO/DPO, which warm-start from it)."""

    r: PositiveInt = Field(16, description="LoRA rank")
    alpha: PositiveInt = Field(32, description="LoRA alpha (scale = alpha / r)")
    dropout: Probability = Field(0.0, description="LoRA dropout probability")


class StageOptions(Strict):
    """Options every stage honours: length, seed, optimisation, schedule, checkpoint and evaluation cadence."""

    steps: PositiveInt = Field(100, description="optimizer steps")
    seed: Int = Field(0, description="seeds torch and the data order")
    grad_clip: PositiveNumber | None = Field(1.0, description="max global grad norm; null: no clipping")
    schedule: Literal["cosine", "constant"] = Field("cosine", description="LR schedule after warmup")
    warmup_steps: NonNegativeInt = Field(0, description="linear LR warmup steps")
    weight_decay: NonNegativeNumber = Field(0.0, description="AdamW weight decay")
    save_every: PositiveInt = Field(50, description="checkpoint every N steps (and at the last step)")
    keep_checkpoints: PositiveInt = Field(2, description="step directories kept under checkpoints/")
    partition: Text = Field("train", description="data partition the stage trains on (a name under data.partitions)")
    data: Mixture | None = Field(
        None, description="what the stage trains on: a partition (a dataset under datasets, or <dataset>.<partition>)"
        " or a weighted mixture {partition: weight}, drawn in proportion to the weights (seeded, resumed exactly); "
        "null: partition")
    eval_partition: Text | None = Field("eval", description="partition graded at the end; null: no evaluation")
    eval_rows: PositiveInt = Field(64, description="rows of eval_partition graded")
    eval_every: NonNegativeInt = Field(0, description="also evaluate every N steps (0: only at the end)")
    eval_max_new_tokens: PositiveInt = Field(12, description="answer length cap when grading eval_partition")
    eval_temperature: NonNegativeNumber = Field(0.0, description="sampling temperature when grading (0: greedy)")
    report_to: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = Field(
        default_factory=list, description="experiment trackers fed the metrics the stage's JSONL gets (each an "
        "extra: pip install 'stitch-lm[tensorboard]'); wandb runs offline, mlflow in a local file store")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="weights' dtype while training")
    activation_checkpointing: Literal["off", "full"] | list[Text] = Field(
        "off", description="recompute decoder layers in backward instead of keeping their activations: off, full "
        "(every layer), or a list of layer kinds (e.g. [linear_attention, moe]; `stitch models --json` lists a "
        "model's kinds)")
    device_memory_gib: PositiveNumber | None = Field(
        None, description="memory of the training device (GiB) that the weights, gradients and AdamW states must fit "
        "in, or the stage is refused at setup with the arithmetic (docs/recipes.md, Memory); null: the device's own "
        "(a GPU's total memory; on CPU the machine's RAM)")

    profile_steps: tuple[PositiveInt, PositiveInt] | None = Field(
        None, description="[first, last]: run these optimizer steps under torch.profiler and write <stage>/profile/ "
        "(trace.json for Perfetto, ops.txt by device time; the top operators in summary.json); null: no profiling")

    @property
    def mixture(self) -> dict[str, float]:
        """The partitions this stage trains on, each with its share (the shares sum to 1)."""
        weights = self.data or {self.partition: 1.0}
        total = sum(weights.values())
        return {name: weight / total for name, weight in weights.items()}

    @model_validator(mode="after")
    def _one_data_field(self) -> StageOptions:
        if self.data is not None and "partition" in self.model_fields_set:
            raise field_error("data", "either data or partition, not both (data names a partition or a mixture)",
                              self.data)
        return self

    @model_validator(mode="after")
    def _checkpointing_kinds_named(self) -> StageOptions:
        kinds = self.activation_checkpointing
        if isinstance(kinds, list) and (not kinds or len(set(kinds)) != len(kinds)):
            raise field_error("activation_checkpointing", "a non-empty list of distinct layer kinds", kinds)
        return self

    @model_validator(mode="after")
    def _profile_steps_inside_the_stage(self) -> StageOptions:
        if self.profile_steps is not None:
            first, last = self.profile_steps
            if not first <= last <= self.steps:
                raise field_error("profile_steps", f"[first, last] with first <= last <= steps={self.steps}",
                                  list(self.profile_steps))
        return self


class AlignmentOptions(StageOptions):
    """Projector only; the LM is frozen."""

    batch_size: PositiveInt = Field(8, description="packs (rows) per optimizer step")
    token_budget: PositiveInt = Field(
        512, description="tokens per pack; at least the encoder's tokens per item + 2 sentinels"
    )
    micro_batch_size: PositiveInt | None = Field(
        None, description="packs per forward/backward; the optimizer steps once per batch_size packs, the loss "
        "normalised over all of the step's labelled tokens (gradient accumulation); null: all batch_size at once")
    buffer_size: PositiveInt = Field(64, description="shuffle buffer (samples)")
    packing: Flag = Field(True, description="pack samples into token_budget rows (the model plugin may refuse)")
    lr_projector: PositiveNumber = Field(1e-3, description="projector learning rate")
    train_turns: Literal["all", "last"] = Field(
        "all", description="assistant turns of a multi-turn row that carry loss: all of them, or only the last")


class SFTOptions(AlignmentOptions):
    """Warm-started projector + a LoRA adapter on the model plugin's target set, or the LM's own weights."""

    lr_adapter: PositiveNumber = Field(3e-3, description="adapter learning rate (train_lm: lora)")
    lora: LoraOptions = Field(default_factory=LoraOptions, description="the adapter SFT creates (train_lm: lora)")
    train_projector: Flag = Field(True, description="keep training the projector (false: the LM side only)")
    train_lm: Literal["lora", "full"] = Field(
        "lora", description="how the LM trains: lora (an adapter on the model plugin's targets) or full (its own "
        "weights, all of them or train_lm_layers; the encoder stays frozen)")
    train_lm_layers: list[LayerEntry] | None = Field(
        None, description="train_lm: full only: what trains, as decoder-layer indices and/or patterns over the LM's "
        "parameter names (fnmatch, e.g. 'model.norm.*'); one that matches nothing is refused; null: every weight")
    lr_lm: PositiveNumber = Field(1e-5, description="learning rate of the LM's own weights (train_lm: full)")

    @model_validator(mode="after")
    def _lm_options_fit_train_lm(self) -> SFTOptions:
        # a value other than the default is refused; the default itself is inert (a resolved recipe writes it)
        full_only, lora_only = ("train_lm_layers", "lr_lm"), ("lora", "lr_adapter")
        for key in full_only if self.train_lm == "lora" else lora_only:
            if getattr(self, key) != SFTOptions.model_fields[key].get_default(call_default_factory=True):
                other = "full" if self.train_lm == "lora" else "lora"
                raise field_error(key, f"no {key} beside train_lm: {self.train_lm} (it applies to train_lm: "
                                       f"{other})", getattr(self, key))
        layers = self.train_lm_layers
        if layers is not None and (not layers or len(set(map(str, layers))) != len(layers)):
            raise field_error("train_lm_layers", "a non-empty list of distinct layer indices or name patterns",
                              layers)
        return self


class GRPOOptions(StageOptions):
    """RL from SFT's adapter and projector with rollouts from an engine and the recipe task's reward."""

    steps: PositiveInt = Field(20, description="optimizer steps")
    schedule: Literal["cosine", "constant"] = Field(
        "constant", description="LR schedule after warmup (constant when train_projector is true)"
    )
    save_every: PositiveInt = Field(10, description="checkpoint every N steps (and at the last step)")
    partition: Text = Field("grpo", description="data partition whose prompts are rolled out")
    prompts_per_step: PositiveInt = Field(8, description="prompts drawn per step")
    group_size: Annotated[Int, Ge(2)] = Field(
        4, description="completions per prompt (advantages are normalised per group)"
    )
    max_new_tokens: PositiveInt = Field(10, description="completion length cap")
    temperature: PositiveNumber = Field(1.0, description="sampling temperature")
    lr_adapter: PositiveNumber = Field(1e-4, description="adapter learning rate")
    lr_projector: PositiveNumber = Field(1e-5, description="projector learning rate (train_projector only)")
    clip_eps: PositiveNumber = Field(0.2, description="PPO ratio clip")
    kl_beta: NonNegativeNumber = Field(0.04, description="weight of the k3 KL to the SFT reference")
    updates_per_batch: PositiveInt = Field(1, description="optimizer steps per rollout batch")
    micro_batch_size: PositiveInt | None = Field(None, description="sequences per forward/backward; null: all")
    train_projector: Flag = Field(False, description="also train the projector (constant LR only)")
    engine: Text = Field("embedded", description="a registered rollout engine")
    placement: Literal["colocated", "ray"] = Field("colocated", description="ray: rollout replicas as Ray actors")
    lora: LoraOptions | None = Field(None, description="restates SFT's adapter (r, alpha must match)")
    log_every: NonNegativeInt = Field(
        1, description="write the sampled completions of every N-th step to completions.jsonl (0: never)")
    flat_reward_steps: NonNegativeInt = Field(
        3, description="warn once after N consecutive steps where every group scored alike (0: never)")

    @model_validator(mode="after")
    def _projector_needs_constant_lr(self) -> GRPOOptions:
        # a warm-started projector group must not be rescaled by a schedule
        if self.train_projector and self.schedule != "constant":
            raise field_error("schedule", "constant (the trainable-projector variant keeps its LR)", self.schedule)
        return self


class DPOOptions(StageOptions):
    """Preference training from SFT's adapter on chosen/rejected pairs (the recipe task's or the dataset's)."""

    steps: PositiveInt = Field(20, description="optimizer steps")
    schedule: Literal["cosine", "constant"] = Field("constant", description="LR schedule after warmup")
    save_every: PositiveInt = Field(10, description="checkpoint every N steps (and at the last step)")
    pairs_per_step: PositiveInt = Field(8, description="pairs per step")
    beta: PositiveNumber = Field(0.1, description="DPO temperature")
    lr_adapter: PositiveNumber = Field(5e-4, description="adapter learning rate")
    micro_batch_size: PositiveInt | None = Field(
        None, description="pairs per forward/backward (gradient accumulation over pairs_per_step); null: all")
    probe_pairs: PositiveInt = Field(32, description="fixed pairs scored before and after training")
    lora: LoraOptions | None = Field(None, description="restates SFT's adapter (r, alpha must match)")
    warm_start: Literal["sft", "grpo"] = Field(
        "sft", description="the earlier stage whose latest checkpoint (adapter + projector) DPO starts from and "
                           "keeps frozen as its reference; the recipe must declare it")


STAGE_OPTIONS: dict[str, type[StageOptions]] = {
    "alignment": AlignmentOptions,
    "sft": SFTOptions,
    "grpo": GRPOOptions,
    "dpo": DPOOptions,
}
