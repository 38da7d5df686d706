"""stitch-qwen: Qwen3.5-4B (dense, hybrid linear attention) and Qwen3.6-35B-A3B (MoE), plus tiny presets.

Both checkpoints are native VLMs; their own vision towers stay frozen and unused. Images reach the LM through
stitch's external route ``clip_image`` (the payload is registered by stitch-clip) as projected soft tokens
between the ``qwen3.5`` sentinels.
"""

from __future__ import annotations

from pathlib import Path

from stitch.api import hookimpl, shipped_recipes
from stitch_qwen.models import MODELS
from stitch_qwen.sentinels import SENTINELS
from stitch_qwen.vlm_layout import VLM_TO_TEXT

__all__ = ["register_models", "register_state_dict_adapters", "register_token_sentinels", "register_recipes"]


@hookimpl
def register_models(register):
    for spec in MODELS:
        register(spec)


@hookimpl
def register_token_sentinels(register):
    register(SENTINELS)


@hookimpl
def register_state_dict_adapters(register):
    register(VLM_TO_TEXT)


@hookimpl
def register_recipes(register):
    for spec in shipped_recipes(Path(__file__).parent / "recipes"):
        register(spec)
