"""`stages.sft.train_lm`: LoRA by default, `full` (with `train_lm_layers`, `lr_lm`) by choice; options that apply
only to the other choice, and later stages that need SFT's adapter, are refused at load naming the field."""

from __future__ import annotations

import copy

import pytest

from stitch.config.recipe import RecipeError, parse_recipe
from tests.stitch_testing import BASE


def _recipe(**sft) -> dict:
    recipe = copy.deepcopy(BASE)
    recipe["stages"]["sft"].update(sft)
    return recipe


def _without_rl(recipe: dict) -> dict:
    del recipe["stages"]["grpo"], recipe["stages"]["dpo"]
    return recipe


def test_sft_trains_lora_by_default_and_full_takes_layers_and_its_own_learning_rate():
    assert parse_recipe(_recipe()).stages["sft"].train_lm == "lora"
    opts = parse_recipe(_without_rl(_recipe(train_lm="full", train_lm_layers=[3, "model.norm.*"], lr_lm="2e-5")))
    sft = opts.stages["sft"]
    assert (sft.train_lm, sft.train_lm_layers, sft.lr_lm) == ("full", [3, "model.norm.*"], 2e-5)


@pytest.mark.parametrize(("sft", "message"), [
    ({"train_lm_layers": [0]}, r"field 'stages\.sft\.train_lm_layers': expected no train_lm_layers beside "
                               r"train_lm: lora"),
    ({"lr_lm": 1e-4}, r"field 'stages\.sft\.lr_lm': expected no lr_lm beside train_lm: lora"),
    ({"train_lm": "full", "lora": {"r": 8}}, r"field 'stages\.sft\.lora': expected no lora beside train_lm: full"),
    ({"train_lm": "full", "lr_adapter": 1e-3}, r"field 'stages\.sft\.lr_adapter': expected no lr_adapter beside"),
    ({"train_lm": "full", "train_lm_layers": []}, r"field 'stages\.sft\.train_lm_layers': expected a non-empty"),
    ({"train_lm": "full", "train_lm_layers": [1, 1]}, r"'stages\.sft\.train_lm_layers': expected a non-empty list "
                                                      r"of distinct"),
    ({"train_lm": "full", "train_lm_layers": [1.5]}, r"field 'stages\.sft\.train_lm_layers': expected a "
                                                     r"decoder-layer index \(an integer from 0\) or a parameter-name "
                                                     r"pattern \(text\), got 1\.5"),
    ({"train_lm": "full", "train_lm_layers": [-1]}, r"field 'stages\.sft\.train_lm_layers': expected a decoder"),
    ({"train_lm": "half"}, r"field 'stages\.sft\.train_lm': expected one of lora, full"),
])
def test_train_lm_option_that_cannot_be_honoured_is_refused_at_load_naming_the_field(sft, message):
    with pytest.raises(RecipeError, match=message):
        parse_recipe(_without_rl(_recipe(**sft)))


@pytest.mark.parametrize("stage", ["grpo", "dpo"])
def test_a_stage_warm_starting_from_sfts_adapter_is_refused_beside_a_full_fine_tune(stage):
    recipe = _recipe(train_lm="full")
    del recipe["stages"]["dpo" if stage == "grpo" else "grpo"]
    with pytest.raises(RecipeError, match=rf"field 'stages\.sft\.train_lm': expected lora while the recipe declares "
                                          rf"{stage}"):
        parse_recipe(recipe)
