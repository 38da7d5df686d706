"""What the core registers itself: projectors, rollout engines and the demo recipe."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from stitch.hookspecs import hookimpl
from stitch.specs import RecipeSpec

RECIPES_DIR = Path(__file__).parent / "recipes"


@hookimpl
def register_projectors(register):
    from stitch.projector import PROJECTORS

    for spec in PROJECTORS:
        register(spec)


@hookimpl
def register_recipes(register):
    register(RecipeSpec("demo", RECIPES_DIR / "demo.yaml", "counting shapes: tiny CLIP + the pre-trained tiny Qwen3.5 demo LM (CPU)"))


@hookimpl
def register_rollout_engines(register):
    from stitch.engines import EmbeddedEngine
    from stitch.specs import RolloutEngineSpec

    register(RolloutEngineSpec(
        "embedded", EmbeddedEngine, "transformers generate(inputs_embeds=...) on the live policy (all architectures)"
    ))
    if importlib.util.find_spec("vllm") is not None:  # vLLM itself is imported only when the engine is built
        from stitch.vllm_engine import vllm_engine_factory

        register(RolloutEngineSpec("vllm", vllm_engine_factory, "vLLM in-process: prompt embeddings, merged "
                                   "weights refit in place (enable_prompt_embeds)"))
