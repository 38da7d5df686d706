"""The hooks a stitch plugin implements, each with the spec type it registers: the one table of hooks.

Every hook receives a ``register`` callback owned by the core; ``register(spec)`` is stamped with the plugin
that made it, type-checked against the hook's spec type, and refused on a duplicate name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pluggy

from stitch.plugins.specs import (
    EncoderSpec,
    ModelSpec,
    ProjectorSpec,
    RecipeSpec,
    RolloutEngineSpec,
    RolloutPayloadSpec,
    SentinelSpec,
    StateDictAdapterSpec,
    TaskSpec,
)

hookspec = pluggy.HookspecMarker("stitch")
hookimpl = pluggy.HookimplMarker("stitch")


@dataclass(frozen=True)
class Hook:
    """One hook: its registry kind (``stitch registry KIND``), the spec type it takes, a noun for messages."""

    name: str
    kind: str
    spec_type: type
    noun: str


HOOKS: dict[str, Hook] = {}


def _hook(kind: str, spec_type: type, noun: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    def declare(function: Callable[..., None]) -> Callable[..., None]:
        HOOKS[kind] = Hook(function.__name__, kind, spec_type, noun)
        return hookspec(function)

    return declare


@_hook("encoders", EncoderSpec, "encoder")
def register_encoders(register: Callable[..., None]) -> None:
    """Register frozen encoders: ``register(EncoderSpec)``."""


@_hook("token_sentinels", SentinelSpec, "token sentinel set")
def register_token_sentinels(register: Callable[..., None]) -> None:
    """Register start/placeholder/end tokens of a tokenizer family: ``register(SentinelSpec)``."""


@_hook("models", ModelSpec, "model")
def register_models(register: Callable[..., None]) -> None:
    """Register base language-model bindings: ``register(ModelSpec)``."""


@_hook("state_dict_adapters", StateDictAdapterSpec, "state-dict adapter")
def register_state_dict_adapters(register: Callable[..., None]) -> None:
    """Register key mappings between checkpoint layouts: ``register(StateDictAdapterSpec)``."""


@_hook("rollout_payloads", RolloutPayloadSpec, "rollout payload")
def register_rollout_payloads(register: Callable[..., None]) -> None:
    """Register how a modality's rows travel to a rollout engine: ``register(RolloutPayloadSpec)``."""


@_hook("rollout_engines", RolloutEngineSpec, "rollout engine")
def register_rollout_engines(register: Callable[..., None]) -> None:
    """Register generation backends for rollouts and inference: ``register(RolloutEngineSpec)``."""


@_hook("projectors", ProjectorSpec, "projector")
def register_projectors(register: Callable[..., None]) -> None:
    """Register projector architectures (features -> LM hidden width): ``register(ProjectorSpec)``."""


@_hook("recipes", RecipeSpec, "recipe")
def register_recipes(register: Callable[..., None]) -> None:
    """Register shipped recipe files (YAML): ``register(RecipeSpec)``."""


@_hook("tasks", TaskSpec, "task")
def register_tasks(register: Callable[..., None]) -> None:
    """Register what a dataset is trained and judged on (reward, grader, DPO pairs): ``register(TaskSpec)``."""
