"""GRPO's rollout engine is checked when the recipe loads: a name nobody registered, or an engine whose refit takes
only the adapter under Ray placement (the replicas receive merged weights), is refused naming the field."""

from __future__ import annotations

import pytest

from stitch.api import RolloutEngineSpec, hookimpl
from stitch.config.recipe import RecipeError, load_recipe
from stitch.host.host import RegistryLookupError, load_plugins
from stitch.host.validate import validate_recipe
from tests.stitch_testing import write_recipe


class _AdapterOnlyEngine:
    @hookimpl
    def register_rollout_engines(self, register):
        register(RolloutEngineSpec("adapter-only", lambda lm, **kw: None, "refit takes the adapter",
                                   merged_refit=False))


@pytest.fixture(scope="module")
def host():
    return load_plugins(extra={"adapter-only-engine": _AdapterOnlyEngine()})


def _recipe(tmp_path, **grpo):
    return load_recipe(write_recipe(tmp_path / "r.yaml", **{f"stages__grpo__{k}": v for k, v in grpo.items()}))


def test_an_unregistered_rollout_engine_is_refused_at_load_naming_the_available_ones(host, tmp_path):
    with pytest.raises(RegistryLookupError, match=r"'vlm'.*Available rollout engines: .*embedded"):
        validate_recipe(_recipe(tmp_path, engine="vlm"), host)


def test_an_adapter_refit_engine_under_ray_placement_is_refused_naming_the_field(host, tmp_path):
    with pytest.raises(RecipeError, match=r"stages\.grpo\.engine.*merged weights under placement: ray "
                                          r"\(embedded.*got 'adapter-only'"):
        validate_recipe(_recipe(tmp_path, engine="adapter-only", placement="ray"), host)


def test_the_same_engine_colocated_and_the_embedded_engine_under_ray_pass(host, tmp_path):
    assert "grpo" in validate_recipe(_recipe(tmp_path, engine="adapter-only"), host)
    assert "grpo" in validate_recipe(_recipe(tmp_path, engine="embedded", placement="ray"), host)
