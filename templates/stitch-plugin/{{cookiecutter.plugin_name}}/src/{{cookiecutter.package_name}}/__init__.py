"""{{ cookiecutter.plugin_name }}: a stitch plugin for {{ cookiecutter.modality }} data.

A frozen encoder, its rollout payload and a demo recipe with its own data.

stitch calls the three functions below (found through the `stitch` entry point in pyproject.toml) and
records what each registers under this plugin's name; `stitch list-plugins` shows them. A plugin imports
from `stitch.api` only: the rest of stitch is internal.
"""

from __future__ import annotations

from pathlib import Path

from stitch.api import feature_payload_spec, hookimpl, shipped_recipes

from {{ cookiecutter.package_name }}.encoder import ENCODER, FEATURE_WIDTH, MODALITY, TOKENS_PER_ITEM

__all__ = ["ENCODER", "PAYLOAD", "register_encoders", "register_recipes", "register_rollout_payloads"]

# How this modality's rows reach a rollout engine (GRPO, evaluation, inference): one field named after the
# modality, holding cached features [items, TOKENS_PER_ITEM, FEATURE_WIDTH], validated before the
# projector turns them into soft tokens. The encoder names it (EncoderSpec.payload in encoder.py).
PAYLOAD = feature_payload_spec(ENCODER.payload, MODALITY, TOKENS_PER_ITEM, FEATURE_WIDTH)

RECIPES = Path(__file__).resolve().parent / "recipes"


@hookimpl
def register_encoders(register):
    register(ENCODER)


@hookimpl
def register_rollout_payloads(register):
    register(PAYLOAD)


@hookimpl
def register_recipes(register):
    # every recipes/*.yaml, by file name: `stitch run {{ cookiecutter.modality }}-demo` finds the demo recipe
    for spec in shipped_recipes(RECIPES):
        register(spec)


# No register_token_sentinels here: sentinel tokens belong to the base model's tokenizer, and the model
# plugin (stitch-qwen, stitch-nemotron...) registers them. README.md, "Why this plugin registers no
# sentinels", says when you would add one.
