"""The recipe schema: each malformed option is refused at load, before any model or data is touched, in one line
naming the file, the field path, what was expected and what was found; overrides; the resolved recipe and its
digest; `stitch recipe show` / `stitch recipe schema`; docs/recipes.md lists every option."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import yaml

from stitch.config.describe import reference_markdown, schema_fields
from stitch.config.options import SFTOptions
from stitch.config.recipe import RecipeError, RecipeFile, TaskConfig, load_recipe, parse_recipe
from stitch.host.host import get_host, load_plugins
from tests.stitch_testing import write_recipe

DOC = Path(__file__).resolve().parents[2] / "docs" / "recipes.md"


def run_cli(args: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """`stitch ARGS` in-process through the console entry point: (exit code, stdout, stderr)."""
    from stitch.cli.main import main

    monkeypatch.setattr(sys, "argv", ["stitch", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


@pytest.fixture
def no_heavy_work(monkeypatch):
    """Any model load or dataset read fails the test: a refusal must come before both."""
    import stitch.data.prepare
    import stitch.model.binding
    import stitch.model.loading

    def touched(*args, **kwargs):
        raise AssertionError("a model or the dataset was touched before the recipe was refused")

    monkeypatch.setattr(stitch.model.loading, "load_model", touched)
    monkeypatch.setattr(stitch.model.binding, "load_model", touched)
    monkeypatch.setattr(stitch.data.prepare, "open_stream", touched)


def refused_by_train(recipe: Path, tmp_path: Path, monkeypatch, capsys) -> str:
    """`stitch train sft --recipe RECIPE --out DIR` exits 2 with one error line, and DIR was never created."""
    out = tmp_path / "run"
    code, _, err = run_cli(["train", "sft", "--recipe", str(recipe), "--out", str(out)], monkeypatch, capsys)
    assert code == 2, err
    assert not out.exists() and not (out / "data").exists()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: recipe ") and str(recipe) in lines[0], err
    return lines[0]


# -- one test per malformed case --------------------------------------------------------------------------


def test_learning_rate_that_is_not_a_number_is_refused_before_any_model_load(tmp_path, monkeypatch, capsys,
                                                                           no_heavy_work):
    line = refused_by_train(write_recipe(tmp_path / "r.yaml", stages__sft__lr_adapter="abc"),
                            tmp_path, monkeypatch, capsys)
    assert "field 'stages.sft.lr_adapter': expected a positive number, got 'abc'" in line


def test_yaml_1e_minus_4_that_pyyaml_reads_as_text_loads_as_the_float_0_0001(tmp_path):
    path = write_recipe(tmp_path / "r.yaml", stages__sft__lr_adapter="1e-4")
    path.write_text(path.read_text().replace("'1e-4'", "1e-4"))
    assert yaml.safe_load(path.read_text())["stages"]["sft"]["lr_adapter"] == "1e-4"  # PyYAML's reading
    lr = load_recipe(path).stages["sft"].lr_adapter
    assert type(lr) is float and lr == 0.0001


def test_unknown_nested_key_lora_rank_is_refused_naming_the_path_and_the_known_keys(tmp_path, monkeypatch, capsys,
                                                                                     no_heavy_work):
    line = refused_by_train(write_recipe(tmp_path / "r.yaml", stages__sft__lora={"rank": 8}),
                            tmp_path, monkeypatch, capsys)
    assert "unknown field 'stages.sft.lora.rank'; expected one of r, alpha, dropout" in line


def test_unknown_top_level_key_is_refused_naming_it(tmp_path, monkeypatch, capsys, no_heavy_work):
    line = refused_by_train(write_recipe(tmp_path / "r.yaml", modle="qwen3.5-demo"), tmp_path, monkeypatch, capsys)
    assert "unknown field 'modle'; expected one of name, model, encoder, projector, task, data, datasets, parallel, stages" \
        in line


def test_unknown_stage_option_is_refused_naming_the_stage_and_the_option(tmp_path, monkeypatch, capsys,
                                                                         no_heavy_work):
    line = refused_by_train(write_recipe(tmp_path / "r.yaml", stages__grpo__kl_coef=0.1),
                            tmp_path, monkeypatch, capsys)
    assert "unknown field 'stages.grpo.kl_coef'; expected one of steps, " in line and "kl_beta" in line


def test_unknown_stage_name_is_refused_listing_the_stages(tmp_path, monkeypatch, capsys, no_heavy_work):
    line = refused_by_train(write_recipe(tmp_path / "r.yaml", stages__ppo={"steps": 3}),
                            tmp_path, monkeypatch, capsys)
    assert "unknown field 'stages.ppo'; expected one of alignment, sft, grpo, dpo" in line


def test_zero_steps_is_refused_as_out_of_range(tmp_path, monkeypatch, capsys, no_heavy_work):
    line = refused_by_train(write_recipe(tmp_path / "r.yaml", stages__sft__steps=0), tmp_path, monkeypatch, capsys)
    assert "field 'stages.sft.steps': expected a positive integer, got 0" in line


def test_grpo_group_of_one_is_refused_as_out_of_range(tmp_path, monkeypatch, capsys, no_heavy_work):
    line = refused_by_train(write_recipe(tmp_path / "r.yaml", stages__grpo__group_size=1),
                            tmp_path, monkeypatch, capsys)
    assert "field 'stages.grpo.group_size': expected an integer >= 2, got 1" in line


def test_lora_dropout_above_one_is_refused_with_the_interval(tmp_path, monkeypatch, capsys, no_heavy_work):
    line = refused_by_train(write_recipe(tmp_path / "r.yaml", stages__sft__lora={"dropout": 1.5}),
                            tmp_path, monkeypatch, capsys)
    assert "field 'stages.sft.lora.dropout': expected a number in [0, 1), got 1.5" in line


def test_boolean_where_a_count_belongs_is_refused(tmp_path, monkeypatch, capsys, no_heavy_work):
    line = refused_by_train(write_recipe(tmp_path / "r.yaml", stages__sft__batch_size=True),
                            tmp_path, monkeypatch, capsys)
    assert "field 'stages.sft.batch_size': expected a positive integer, got True" in line


def test_stage_partition_missing_from_the_data_is_refused(tmp_path, monkeypatch, capsys, no_heavy_work):
    line = refused_by_train(write_recipe(tmp_path / "r.yaml", stages__dpo__eval_partition="holdout"),
                            tmp_path, monkeypatch, capsys)
    assert "field 'stages.dpo.eval_partition': expected one of the data partitions alignment, train, eval, grpo, " \
           "got 'holdout'" in line


def test_grpo_without_an_sft_stage_to_warm_start_from_is_refused(tmp_path, monkeypatch, capsys, no_heavy_work):
    path = write_recipe(tmp_path / "r.yaml")
    recipe = yaml.safe_load(path.read_text())
    del recipe["stages"]["sft"]
    path.write_text(yaml.safe_dump(recipe))
    line = refused_by_train(path, tmp_path, monkeypatch, capsys)
    assert "field 'stages.grpo': expected a recipe that also declares 'sft'" in line


def test_grpo_projector_training_with_a_cosine_schedule_is_refused(tmp_path, monkeypatch, capsys, no_heavy_work):
    line = refused_by_train(write_recipe(tmp_path / "r.yaml", stages__grpo__train_projector=True,
                                         stages__grpo__schedule="cosine"), tmp_path, monkeypatch, capsys)
    assert "field 'stages.grpo.schedule': expected constant" in line and "got 'cosine'" in line


def test_task_with_both_a_name_and_a_reward_is_refused(tmp_path, monkeypatch, capsys, no_heavy_work):
    line = refused_by_train(write_recipe(tmp_path / "r.yaml", task={"name": "counting", "reward": "m:f"}),
                            tmp_path, monkeypatch, capsys)
    assert "field 'task': expected exactly one of 'name' or 'reward'" in line


def test_task_reward_that_is_not_module_colon_function_is_refused(tmp_path, monkeypatch, capsys, no_heavy_work):
    line = refused_by_train(write_recipe(tmp_path / "r.yaml", task={"reward": "my_rewards.exact"}),
                            tmp_path, monkeypatch, capsys)
    assert "field 'task.reward': expected 'module:function', got 'my_rewards.exact'" in line


def test_override_of_a_key_that_does_not_exist_is_refused_naming_the_path(tmp_path, monkeypatch, capsys):
    path = write_recipe(tmp_path / "r.yaml")
    with pytest.raises(RecipeError) as err:
        load_recipe(path, overrides=("stages.sft.lora.rank=4",))
    assert "unknown field 'stages.sft.lora.rank'; expected one of r, alpha, dropout (set by override " \
           "'stages.sft.lora.rank=4')" in str(err.value)
    code, out, err_text = run_cli(["recipe", "show", str(path), "stages.sft.lr=1e-4"], monkeypatch, capsys)
    assert code == 2 and not out and "unknown field 'stages.sft.lr'" in err_text


def test_override_below_a_plain_value_is_refused_naming_the_value(tmp_path):
    with pytest.raises(RecipeError, match=r"override 'stages\.sft\.steps\.max=3': field 'stages\.sft\.steps' holds "
                                          r"2, not a mapping"):
        load_recipe(write_recipe(tmp_path / "r.yaml"), overrides=("stages.sft.steps.max=3",))


def test_override_without_an_equals_sign_is_refused(tmp_path):
    with pytest.raises(RecipeError, match=r"override 'stages\.sft\.steps': expected dotted\.key=value"):
        load_recipe(write_recipe(tmp_path / "r.yaml"), overrides=("stages.sft.steps",))


# -- overrides, the resolved recipe and the digest ------------------------------------------------------------


def test_override_values_parse_as_yaml_then_go_through_the_schema(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml"), overrides=(
        "stages.sft.lr_adapter=1e-4", "stages.sft.lora={r: 8, alpha: 16}", "stages.grpo.lora={r: 8, alpha: 16}",
        "data.on_corrupt=skip", "stages.grpo.eval_partition=null", "task=counting"))
    sft = recipe.stages["sft"]
    assert isinstance(sft, SFTOptions) and sft.lr_adapter == 0.0001 and (sft.lora.r, sft.lora.alpha) == (8, 16)
    assert recipe.data.on_corrupt == "skip" and recipe.stages["grpo"].eval_partition is None
    assert recipe.task == TaskConfig(name="counting")


def test_override_that_changes_steps_shows_in_recipe_show_and_changes_the_digest(tmp_path, monkeypatch, capsys):
    path = write_recipe(tmp_path / "r.yaml")
    code, plain, _ = run_cli(["recipe", "show", str(path)], monkeypatch, capsys)
    assert code == 0
    code, overridden, _ = run_cli(["recipe", "show", str(path), "stages.sft.steps=50"], monkeypatch, capsys)
    assert code == 0
    assert yaml.safe_load(plain)["stages"]["sft"]["steps"] == 2
    assert yaml.safe_load(overridden)["stages"]["sft"]["steps"] == 50
    digest_line = [line for line in overridden.splitlines() if line.startswith("# sha256 ")]
    recipe = load_recipe(path, overrides=("stages.sft.steps=50",))
    assert digest_line == [f"# sha256 {recipe.digest}"]
    assert recipe.digest != load_recipe(path).digest
    assert recipe.digest == hashlib.sha256(recipe.resolved_yaml().encode()).hexdigest()


def test_digest_hashes_the_resolved_recipe_not_its_spelling(tmp_path):
    path = write_recipe(tmp_path / "r.yaml")
    respelled = tmp_path / "other" / "r.yaml"
    respelled.parent.mkdir()
    mapping = yaml.safe_load(path.read_text())
    mapping["stages"]["sft"]["seed"] = 0  # the default, now spelled out
    respelled.write_text("# a comment\n" + yaml.safe_dump(dict(reversed(list(mapping.items())))))
    assert load_recipe(respelled).digest == load_recipe(path).digest
    assert load_recipe(path, overrides=("stages.sft.seed=1",)).digest != load_recipe(path).digest


def test_resolved_yaml_loads_back_into_the_same_recipe(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", parallel={"world_size": 2, "gpus": {"policy": 1}}),
                         overrides=("task={reward: 'my_rewards:score'}", "data.columns.rejected=worse"))
    again = parse_recipe(yaml.safe_load(recipe.resolved_yaml()), path=recipe.path)
    assert again == recipe and again.digest == recipe.digest
    assert again.task == TaskConfig(reward="my_rewards:score") and again.data.columns.rejected == "worse"
    assert again.parallel.roles_given and again.parallel.rollout_gpus == 1


def test_stage_options_of_an_undeclared_stage_names_it(tmp_path):
    path = write_recipe(tmp_path / "r.yaml")
    mapping = yaml.safe_load(path.read_text())
    del mapping["stages"]["dpo"]
    recipe = parse_recipe(mapping, path=path)
    assert recipe.stage_options("sft").lora.r == 16
    with pytest.raises(RecipeError, match=r"no stage 'dpo' under 'stages'; it declares alignment, sft, grpo"):
        recipe.stage_options("dpo")


def test_a_recipe_without_a_task_gets_the_documented_default(tmp_path):
    mapping = yaml.safe_load(write_recipe(tmp_path / "r.yaml").read_text())
    del mapping["task"]
    assert parse_recipe(mapping).task == TaskConfig(name="exact-match")
    assert "default exact-match" in DOC.read_text()


# -- shipped recipes, the CLI schema, the reference --------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(load_plugins().names("recipes")))
def test_every_shipped_recipe_loads_and_its_resolved_form_round_trips(name):
    recipe = load_recipe(name, get_host())
    assert recipe.stages and all(recipe.stage_options(stage) is recipe.stages[stage] for stage in recipe.stages)
    again = parse_recipe(yaml.safe_load(recipe.resolved_yaml()), path=recipe.path)
    assert again.digest == recipe.digest


def test_recipe_schema_prints_a_json_schema_that_refuses_unknown_stage_options(monkeypatch, capsys):
    code, out, _ = run_cli(["recipe", "schema"], monkeypatch, capsys)
    schema = json.loads(out)
    assert code == 0 and set(schema["required"]) == {"name", "model", "encoder", "data"}
    sft = schema["$defs"]["SFTOptions"]
    assert sft["additionalProperties"] is False and sft["properties"]["steps"]["exclusiveMinimum"] == 0
    assert schema["$defs"]["StagesConfig"]["additionalProperties"] is False


def test_docs_recipes_lists_every_recipe_field():
    text = DOC.read_text()
    missing = [path for path, *_ in schema_fields(RecipeFile) if f"`{path}`" not in text]
    assert not missing, f"docs/recipes.md does not list {missing}"


def test_docs_recipes_reference_table_is_the_one_the_schema_generates():
    assert reference_markdown(RecipeFile) in DOC.read_text(), "regenerate it: stitch recipe schema --markdown"


def test_config_package_imports_no_stage_serve_or_cli_module_even_inside_functions():
    import ast

    config = Path(__file__).resolve().parents[2] / "stitch" / "config"
    upward = []
    for source in sorted(config.glob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            upward += [f"{source.name}: {n}" for n in names if n.split(".")[:2] in (
                ["stitch", "stages"], ["stitch", "serve"], ["stitch", "cli"])]
    assert not upward


def test_stitch_run_with_only_overrides_applies_them_to_the_default_recipe(tmp_path, monkeypatch, capsys):
    """`stitch run key=value` overrides the default recipe `demo` (the first override is not a recipe name): a bad
    key is refused as an override of demo, before any run directory exists."""
    monkeypatch.chdir(tmp_path)
    code, _, err_text = run_cli(["run", "stages.sft.lr=1e-4", "--out", str(tmp_path / "run")], monkeypatch, capsys)
    assert code == 2 and "unknown field 'stages.sft.lr'" in err_text and "(set by override" in err_text
    assert not (tmp_path / "run").exists()
