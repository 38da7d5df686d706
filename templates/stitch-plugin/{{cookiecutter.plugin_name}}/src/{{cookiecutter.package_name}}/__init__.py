"""{{ cookiecutter.plugin_name }}: a frozen {{ cookiecutter.modality }} encoder and its rollout payload, as a stitch plugin.

stitch calls the two functions below (found through the `stitch` entry point in pyproject.toml) and
records what each registers under this plugin's name; `stitch list-plugins` shows them.
"""

from __future__ import annotations

from stitch.api import hookimpl
from stitch.api import feature_payload_spec

from {{ cookiecutter.package_name }}.encoder import ENCODER, FEATURE_WIDTH, MODALITY, TOKENS_PER_ITEM

__all__ = ["ENCODER", "PAYLOAD", "register_encoders", "register_rollout_payloads"]

# How this modality's rows reach a rollout engine (GRPO, DPO, inference): one field named after the
# modality, holding cached features [items, TOKENS_PER_ITEM, FEATURE_WIDTH], validated before the
# projector turns them into soft tokens.
PAYLOAD = feature_payload_spec(MODALITY, MODALITY, TOKENS_PER_ITEM, FEATURE_WIDTH)


@hookimpl
def register_encoders(register):
    register(ENCODER)


@hookimpl
def register_rollout_payloads(register):
    register(PAYLOAD)


# No register_token_sentinels here: sentinel tokens belong to the base model's tokenizer, and the model
# plugin (stitch-qwen, stitch-nemotron...) registers them. README.md, "Why this plugin registers no
# sentinels", says when you would add one.
