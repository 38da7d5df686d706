"""Recipes with named datasets: each stage names a partition or a weighted mixture; every name, weight and field
clash is refused at load naming the field, the expected and the actual value; the resolved recipe parses again."""

from __future__ import annotations

import copy

import pytest
import yaml

from stitch.config.recipe import RecipeError, parse_recipe

RECIPE = {
    "name": "three", "model": "qwen3.5-tiny", "encoder": "clip-tiny", "task": "counting",
    "data": {"budgets": {"transient_mib": 64, "retained_mib": 16}},
    "datasets": {
        "captions": {"source": {"builtin": "counting-shapes", "rows": 8, "caption_rows": 8},
                     "columns": {"media": "image", "question": "question", "answer": "answer"}, "rows": 8},
        "instruct": {"source": {"path": "rows.jsonl", "format": "json"},
                     "columns": {"media": "images", "messages": "messages"}, "rows": 6, "on_corrupt": "skip"},
        "math": {"source": {"builtin": "counting-shapes", "rows": 16},
                 "columns": {"media": "image", "question": "question", "answer": "answer"},
                 "partitions": {"train": [0, 12], "eval": [12, 16]}},
    },
    "stages": {
        "alignment": {"data": "captions", "eval_partition": None},
        "sft": {"data": {"instruct": 0.8, "captions": 0.2}, "eval_partition": "math.eval"},
        "grpo": {"data": "math.train", "eval_partition": "math.eval"},
    },
}


def _parse(tmp_path, **changes):
    mapping = copy.deepcopy(RECIPE)
    for dotted, value in changes.items():
        node = mapping
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node[part]
        if value is _DROP:
            node.pop(leaf)
        else:
            node[leaf] = value
    return parse_recipe(mapping, path=tmp_path / "r.yaml")


_DROP = object()


def test_each_dataset_becomes_partitions_named_after_it_with_its_own_checks_and_the_shared_fields(tmp_path):
    recipe = _parse(tmp_path)
    assert [p.name for p in recipe.partitions] == ["captions", "instruct", "math.train", "math.eval"]
    data = recipe.datasets
    assert data["instruct"].on_corrupt == "skip" and data["math"].on_corrupt == "error"
    assert data["instruct"].source.path == tmp_path / "rows.jsonl"  # relative to the recipe's folder
    assert data["math"].scan_cap == 16 and data["captions"].budgets.retained_mib == 16
    assert recipe.stages["sft"].mixture == {"instruct": 0.8, "captions": 0.2}
    assert recipe.stages["alignment"].mixture == {"captions": 1.0}
    again = parse_recipe(yaml.safe_load(recipe.resolved_yaml()), path=recipe.path)
    assert again.digest == recipe.digest and again.datasets == recipe.datasets


@pytest.mark.parametrize(("changes", "message"), [
    ({"stages__sft__data": {"instruct": 0.8, "captoins": 0.2}},
     "field 'stages.sft.data.captoins': expected one of the datasets' partitions captions, instruct, math.train, "
     "math.eval, got 'captoins'"),
    ({"stages__sft__data": {"instruct": -1, "captions": 0.2}},
     "field 'stages.sft.data.instruct': expected a positive number (the partition's weight in the mixture), got -1"),
    ({"stages__sft__data": {}}, "field 'stages.sft.data': expected a partition name or a non-empty mapping"),
    ({"stages__grpo__data": "math"}, "field 'stages.grpo.data.math': expected one of the datasets' partitions"),
    ({"stages__grpo__data": _DROP}, "field 'stages.grpo.data' is missing; expected one of the datasets' partitions"),
    ({"stages__grpo__partition": "math.train"}, "field 'stages.grpo.data': expected either data or partition"),
    ({"stages__alignment__eval_partition": "eval"},
     "field 'stages.alignment.eval_partition': expected one of the datasets' partitions"),
    ({"data__source": {"builtin": "counting-shapes", "rows": 4}},
     "field 'data.source': expected null in a recipe that declares datasets"),
    ({"datasets__math__rows": 4}, "field 'datasets.math.rows': expected exactly one of rows"),
    ({"datasets__captions__rows": 9}, "field 'datasets.captions.source.rows': expected at least 9"),
    ({"datasets__math__partitions": {"tr.ain": [0, 4]}}, "field 'datasets.math.partitions.tr.ain': expected a "
                                                          "partition name without '.'"),
    ({"datasets": {"ma.th": RECIPE["datasets"]["math"]}}, "field 'datasets.ma.th': expected a dataset name"),
])
def test_a_bad_dataset_or_mixture_is_refused_at_load_naming_the_field(tmp_path, changes, message):
    with pytest.raises(RecipeError) as err:
        _parse(tmp_path, **changes)
    assert message in str(err.value)


def test_a_stage_partition_in_a_datasets_recipe_is_refused_with_the_field_to_use_instead(tmp_path):
    mapping = copy.deepcopy(RECIPE)
    mapping["stages"]["grpo"] = {"partition": "math.train", "eval_partition": None}
    with pytest.raises(RecipeError, match=r"field 'stages.grpo.partition': expected unset in a recipe with datasets: "
                                          r"name what the stage trains on in stages.grpo.data"):
        parse_recipe(mapping)


def test_a_single_source_recipe_may_mix_its_own_partitions(tmp_path):
    from tests.stitch_testing import BASE

    mapping = copy.deepcopy(BASE)
    mapping["stages"]["sft"] = {"data": {"train": 3, "alignment": 1}, "eval_partition": None}
    recipe = parse_recipe(mapping)
    assert recipe.stages["sft"].mixture == {"train": 0.75, "alignment": 0.25}
    assert list(recipe.datasets) == ["data"] and recipe.datasets["data"] is recipe.data
