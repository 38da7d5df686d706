"""The plugin API: everything a stitch plugin may import, in one module (see docs/plugin-api.md).

Plugins import from ``stitch.api`` only; the rest of ``stitch`` is internal and may move between releases
(``tests/test_layout.py`` checks the first-party plugins and the template for this).
"""

from __future__ import annotations

from stitch.config.recipe import shipped_recipes
from stitch.demo.pretrain import pretrain_in_place
from stitch.demo.tiny import chatml_template, padded_vocab_size, train_tokenizer
from stitch.model.varlen import (
    fla_conv,
    fla_kernels_importable,
    flatten_packed_rows,
    reference_conv,
    segments,
    varlen_kernels_ready,
)
from stitch.plugins.hookspecs import hookimpl
from stitch.plugins.specs import (
    EncoderSpec,
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
    # building blocks for registrations
    "PayloadError",
    "feature_payload_spec",
    "shipped_recipes",
    # tiny presets (random-init snapshots built locally) and the demo base's pre-training
    "chatml_template",
    "padded_vocab_size",
    "train_tokenizer",
    "pretrain_in_place",
    # packed training of hybrid layers: sample starts on one flattened row
    "fla_conv",
    "fla_kernels_importable",
    "flatten_packed_rows",
    "reference_conv",
    "segments",
    "varlen_kernels_ready",
]
