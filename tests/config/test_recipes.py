"""Every shipped recipe loads, resolves and validates; each is run by a test or listed with the reason."""

from __future__ import annotations

import pytest

from benchmarks.suites.models import MODELS as MEASURED_MODELS
from benchmarks.suites.models import SETTINGS
from stitch.config.recipe import RecipeError, load_recipe
from stitch.host.host import get_host, load_plugins
from stitch.host.validate import validate_recipe
from tests.stitch_testing import write_recipe

RUN_BY_TESTS = {
    "demo": "tests/demo/test_demo_chain.py runs `stitch run demo` end to end",
    "demo-colors": "tests/stages/test_user_task_chain.py runs `stitch run demo-colors --dpo` with its rows and steps shrunk",
}
NOT_RUN = {
    "qwen3.5-4b": "needs the pinned Qwen3.5-4B weights (hub) and an H200; its tiny twin qwen3.5-tiny "
    "runs alignment + SFT in tests/stages/test_training.py; its batch is the models benchmark's (test below)",
    "qwen3.6-35b-a3b": "needs the pinned 35B MoE weights (hub) and an H200; qwen3.5-moe-tiny stands in for tests",
    "nemotron-3-nano-4b": "needs the pinned Nemotron Nano weights (hub) and an H200; nemotron-nano-tiny stands in",
    "nemotron-3.5-lightning-30b-a3b": "needs the pinned Lightning weights (hub) and an H200; "
    "nemotron-lightning-tiny stands in",
    "qwen3.5-4b-grpo-2gpu": "needs 2 GPUs and the pinned Qwen3.5-4B weights; its layout is checked in "
    "tests/config/test_parallel_recipes.py and its Ray/refit path runs on CPU (gloo) in tests/stages/test_ray_grpo.py",
    "qwen3.5-4b-grpo-8gpu": "needs 8 GPUs and the pinned Qwen3.5-4B weights; its layout is checked in "
    "tests/config/test_parallel_recipes.py",
}
SHIPPED = sorted(load_plugins().names("recipes"))


def test_every_shipped_recipe_is_run_by_a_test_or_listed_with_a_reason():
    assert sorted(RUN_BY_TESTS.keys() | NOT_RUN.keys()) == SHIPPED
    assert not RUN_BY_TESTS.keys() & NOT_RUN.keys()


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipe_loads_resolves_and_validates(name):
    recipe = load_recipe(name, get_host())
    resolved = validate_recipe(recipe, get_host())
    assert "sft" in resolved and "alignment" in resolved
    assert resolved == recipe.stages
    if "grpo" in resolved and resolved["grpo"].lora:
        assert resolved["grpo"].lora.r == resolved["sft"].lora.r


@pytest.mark.parametrize("name", MEASURED_MODELS)
def test_seed_model_recipes_train_at_the_batch_the_models_benchmark_measures(name):
    settings, stages = SETTINGS[name], load_recipe(name, get_host()).stages
    for stage in ("alignment", "sft"):
        opts = stages[stage]
        assert (opts.token_budget, opts.batch_size, opts.micro_batch_size) == (settings.budget, settings.batch,
                                                                             settings.micro), stage
    assert {stages[s].activation_checkpointing for s in ("alignment", "sft", "grpo")} == {settings.checkpointing}
    assert stages["grpo"].micro_batch_size == settings.grpo_micro
    assert {opts.dtype for opts in stages.values()} == {"bfloat16"}  # fp32 weights of a 35B MoE fill an H200


def test_grpo_lora_that_does_not_restate_sft_is_refused_at_load(tmp_path):
    with pytest.raises(RecipeError, match=r"stages\.grpo\.lora\.r.*expected 16.*got 8"):
        load_recipe(write_recipe(tmp_path / "r.yaml", stages__grpo__lora={"r": 8, "alpha": 32}))


def test_token_budget_below_one_media_block_is_refused_with_the_arithmetic(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", stages__sft__token_budget=40))
    with pytest.raises(RecipeError, match=r"at least 51 \(49 soft tokens \+ 2 sentinels\), got 40"):
        validate_recipe(recipe, get_host())


def test_unknown_stage_option_is_refused_at_load_naming_the_field(tmp_path):
    with pytest.raises(RecipeError, match=r"unknown field 'stages\.sft\.learning_rate'; expected one of steps, "):
        load_recipe(write_recipe(tmp_path / "r.yaml", stages__sft__learning_rate=1e-3))
