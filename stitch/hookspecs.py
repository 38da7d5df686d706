"""The hooks a stitch plugin implements; each receives a `register` callback owned by the core."""

from __future__ import annotations

from collections.abc import Callable

import pluggy

hookspec = pluggy.HookspecMarker("stitch")
hookimpl = pluggy.HookimplMarker("stitch")


@hookspec
def register_encoders(register: Callable[..., None]) -> None:
    """Register frozen encoders: ``register(EncoderSpec)``."""


@hookspec
def register_token_sentinels(register: Callable[..., None]) -> None:
    """Register start/placeholder/end tokens of a tokenizer family: ``register(SentinelSpec)``."""


@hookspec
def register_models(register: Callable[..., None]) -> None:
    """Register base language-model bindings: ``register(ModelSpec)``."""


@hookspec
def register_state_dict_adapters(register: Callable[..., None]) -> None:
    """Register key mappings between checkpoint layouts: ``register(StateDictAdapterSpec)``."""


@hookspec
def register_rollout_payloads(register: Callable[..., None]) -> None:
    """Register how a modality's rows travel to a rollout engine: ``register(RolloutPayloadSpec)``."""


@hookspec
def register_rollout_engines(register: Callable[..., None]) -> None:
    """Register generation backends for rollouts and inference: ``register(RolloutEngineSpec)``."""


@hookspec
def register_projectors(register: Callable[..., None]) -> None:
    """Register projector architectures (features -> LM hidden width): ``register(ProjectorSpec)``."""


@hookspec
def register_recipes(register: Callable[..., None]) -> None:
    """Register shipped recipe files (YAML): ``register(RecipeSpec)``."""
