"""stitch-nemotron: Nemotron-3-Nano-4B (hybrid Mamba) and Nemotron-3.5-Lightning-30B-A3B (hybrid MoE), tiny presets.

Models load as stitch's ``NemotronHForCausalLM`` (stock class plus ``generate(inputs_embeds=...)``).
"""

from __future__ import annotations

from pathlib import Path

from stitch.api import hookimpl, shipped_recipes
from stitch_nemotron.models import MODELS
from stitch_nemotron.sentinels import SENTINELS

__all__ = ["register_models", "register_token_sentinels", "register_recipes"]


@hookimpl
def register_models(register):
    for spec in MODELS:
        register(spec)


@hookimpl
def register_token_sentinels(register):
    register(SENTINELS)


@hookimpl
def register_recipes(register):
    for spec in shipped_recipes(Path(__file__).parent / "recipes"):
        register(spec)
