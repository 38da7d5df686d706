"""What the core registers itself: projectors, rollout engines, the generic tasks, and the demo package's
recipes and tasks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from stitch.demo.colors import COLOR_NAMING
from stitch.demo.counting import COUNTING
from stitch.model.projector import PROJECTORS
from stitch.plugins.hookspecs import hookimpl
from stitch.plugins.specs import RecipeSpec, RolloutEngineSpec
from stitch.rollout.engines import EmbeddedEngine
from stitch.rollout.vllm_engine import vllm_engine_factory, vllm_lora_engine_factory
from stitch.tasks.generic import CONTAINS, EXACT_MATCH

RECIPES_DIR = Path(__file__).resolve().parent.parent / "demo" / "recipes"


@hookimpl
def register_projectors(register):
    for spec in PROJECTORS:
        register(spec)


@hookimpl
def register_recipes(register):
    register(RecipeSpec("demo", RECIPES_DIR / "demo.yaml", "counting shapes: tiny CLIP + the pre-trained tiny Qwen3.5 demo LM (CPU)"))
    register(RecipeSpec("demo-colors", RECIPES_DIR / "demo-colors.yaml",
                        "name the colour of a shape (free-text answer): tiny CLIP + tiny Qwen3.5 demo LM (CPU)"))


@hookimpl
def register_rollout_engines(register):
    register(RolloutEngineSpec(
        "embedded", EmbeddedEngine,
        "the live policy from prompt embeddings: fixed KV cache + CUDA-graph decode steps where the model allows "
        "(attention, Gated DeltaNet, Mamba-2 and MoE layers; CUDA graphs on a GPU), transformers "
        "generate(inputs_embeds=...) elsewhere",
    ))
    if importlib.util.find_spec("vllm") is not None:  # vLLM itself is imported only when the engine is built
        register(RolloutEngineSpec("vllm", vllm_engine_factory, "vLLM in-process: prompt embeddings, merged "
                                   "weights refit in place (enable_prompt_embeds)"))
        register(RolloutEngineSpec("vllm-lora", vllm_lora_engine_factory, "vLLM in-process: prompt embeddings, "
                                   "base weights loaded once, each refit ships only the LoRA adapter (vLLM's LoRA)",
                                   merged_refit=False))


@hookimpl
def register_tasks(register):
    for spec in (EXACT_MATCH, CONTAINS, COUNTING, COLOR_NAMING):
        register(spec)
