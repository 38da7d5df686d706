"""The plugin API: hook marker, spec types and building blocks for registrations (see docs/plugin-api.md).

Plugins import ``stitch.api`` and, for the kernels a model's layers call, ``stitch.accel``; the rest of ``stitch``
is internal and may move between releases (``tests/plugins/test_hooks_used.py`` walks the first-party plugins and the
template with ``ast`` for this).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stitch.config.recipe import shipped_recipes
from stitch.demo import tiny
from stitch.host.host import load_plugins
from stitch.model.automodel import automodel_backend
from stitch.model.snapshots import shrink_layer_pattern, write_random_weights
from stitch.plugins.hookspecs import hookimpl
from stitch.plugins.specs import (
    EncoderSpec,
    ModelBackend,
    ModelSource,
    ModelSpec,
    ProjectorSpec,
    RecipeSpec,
    RolloutEngineSpec,
    RolloutPayloadSpec,
    SentinelSpec,
    StateDictAdapterSpec,
    TaskRow,
    TaskSpec,
)
from stitch.rollout.payloads import PayloadError, feature_payload_spec

__all__ = [
    # hooks and what they register
    "hookimpl",
    "EncoderSpec",
    "ModelBackend",
    "ModelSource",
    "ModelSpec",
    "ProjectorSpec",
    "RecipeSpec",
    "RolloutEngineSpec",
    "RolloutPayloadSpec",
    "SentinelSpec",
    "StateDictAdapterSpec",
    "TaskRow",
    "TaskSpec",
    # a plugin's own tests: load the plugins as stitch does and look the registrations up
    "load_plugins",
    # building blocks for registrations
    "PayloadError",
    "automodel_backend",
    "feature_payload_spec",
    "shipped_recipes",
    # tiny presets (random-init snapshots built locally) and the demo base's pre-training
    "chatml_template",
    "padded_vocab_size",
    "train_tokenizer",
    "pretrain_in_place",
    # full-size random-init snapshots in a published checkpoint layout (`stitch snapshot`)
    "shrink_layer_pattern",
    "write_random_weights",
]

# The tiny presets' building blocks live in stitch.demo (stitch.demo.tiny imports transformers only when called).


def chatml_template(start: str = "<|im_start|>", end: str = "<|im_end|>") -> str:
    """A ChatML-style chat template with the given role markers (``stitch.demo.tiny.chatml_template``)."""
    return tiny.chatml_template(start, end)


def train_tokenizer(out_dir: Path, special_tokens: Sequence[str], **options: Any) -> None:
    """Train and save a small BPE tokenizer for a tiny preset (``stitch.demo.tiny.train_tokenizer``: keyword
    options ``eos_token``, ``pad_token``, ``chat_template``, ``vocab_size``, ``corpus``...)."""
    tiny.train_tokenizer(out_dir, special_tokens, **options)


def padded_vocab_size(tokenizer_dir: Path, multiple: int = 64) -> int:
    """Embedding rows for a saved tokenizer: its length rounded up to ``multiple``."""
    return tiny.padded_vocab_size(tokenizer_dir, multiple)


def pretrain_in_place(model_dir: Path, sentinels: tuple[str, str, str], **options: Any) -> None:
    """Pre-train a tiny preset's snapshot on task-style text and save it back (``stitch.demo.pretrain``: keyword
    options ``steps``, ``batch_size``, ``lr``, ``tokens_per_item``, ``seed``)."""
    from stitch.demo import pretrain  # deferred: plugin loading skips transformers (pretrain imports it)

    pretrain.pretrain_in_place(model_dir, sentinels, **options)
