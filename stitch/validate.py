"""Resolve and validate a whole recipe before anything heavy runs: registrations, every stage's options,
and cross-stage contracts (the GRPO/DPO warm start must restate SFT's LoRA rank and alpha)."""

from __future__ import annotations

from typing import Any

from stitch.recipe import Recipe, RecipeError

KNOWN_STAGES = ("alignment", "sft", "grpo", "dpo")


def validate_recipe(recipe: Recipe, host: Any = None) -> dict[str, Any]:
    """The parsed options of every stage; raises naming the field at fault."""
    from stitch.dpo import DPOOptions
    from stitch.grpo import GRPOOptions
    from stitch.plugins import get_host
    from stitch.training import StageOptions

    host = host or get_host()
    model = host.get("models", recipe.model)
    encoder = host.get("encoders", recipe.encoder)
    host.get("projectors", recipe.projector)
    host.get("token_sentinels", model.sentinels)
    unknown = sorted(set(recipe.stages) - set(KNOWN_STAGES))
    if unknown:
        raise RecipeError(f"recipe {recipe.name!r}: unknown stage 'stages.{unknown[0]}'; known: {list(KNOWN_STAGES)}")
    resolved: dict[str, Any] = {}
    for stage in ("alignment", "sft"):
        if stage in recipe.stages:
            opts = StageOptions.from_recipe(recipe, stage)
            # a sample holds at least one media block: start + placeholders + end
            floor = encoder.tokens_per_item + 2
            if opts.token_budget < floor:
                raise RecipeError(
                    f"recipe {recipe.name!r}: field 'stages.{stage}.token_budget': expected at least {floor} "
                    f"({encoder.tokens_per_item} soft tokens + 2 sentinels), got {opts.token_budget}"
                )
            resolved[stage] = opts
    if "grpo" in recipe.stages:
        resolved["grpo"] = GRPOOptions.from_recipe(recipe)
    if "dpo" in recipe.stages:
        resolved["dpo"] = DPOOptions.from_recipe(recipe)
    for stage in ("grpo", "dpo"):
        if stage in recipe.stages and "sft" not in recipe.stages:
            raise RecipeError(f"recipe {recipe.name!r}: stage {stage!r} warm-starts from 'sft', which it lacks")
    if "grpo" in resolved and resolved["grpo"].lora is not None and "sft" in resolved:
        sft_lora, grpo_lora = resolved["sft"].lora, resolved["grpo"].lora
        for key in ("r", "alpha"):
            if sft_lora.get(key) != grpo_lora.get(key):
                raise RecipeError(
                    f"recipe {recipe.name!r}: field 'stages.grpo.lora.{key}': the warm start restates SFT's "
                    f"adapter, expected {sft_lora.get(key)!r}, got {grpo_lora.get(key)!r}"
                )
    partitions = {p.name for p in recipe.data.partitions}
    for stage, opts in resolved.items():
        for key in ("partition", "eval_partition"):
            value = getattr(opts, key, None)
            if value is not None and value not in partitions:
                raise RecipeError(
                    f"recipe {recipe.name!r}: field 'stages.{stage}.{key}': expected one of {sorted(partitions)}, "
                    f"got {value!r}"
                )
    return resolved
