"""Training at a realistic batch: gradient accumulation equals one big batch, activation checkpointing equals no
checkpointing, and both are recipe options every stage honours."""

from __future__ import annotations

import shutil
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from stitch.config.recipe import RecipeError, load_recipe
from stitch.host.host import get_host
from stitch.model.checkpointing import CheckpointingError, decoder_layers, layer_kind
from stitch.stages.loop import setup
from tests.stitch_testing import copy_prepared, write_recipe


def _one_step(recipe_path: Path, run: Path, stage: str) -> tuple[dict, dict[str, torch.Tensor], object]:
    """One step of ``stage``: its metrics record and the gradients the optimizer received."""
    recipe = load_recipe(recipe_path)
    with ExitStack() as cleanup:
        ctx = setup(recipe, stage, run, cleanup, resume=False, progress=False, registry=get_host())
        ctx.model.train()
        grads: dict[str, torch.Tensor] = {}
        update = ctx.update

        def recording_update() -> float:
            grads.update({n: p.grad.detach().clone() for n, p in ctx.model.named_parameters()
                          if p.grad is not None})
            return update()

        ctx.update = recording_update
        ctx.runner.start(ctx)
        record = ctx.runner.step(ctx)
        return record, grads, ctx


def _fresh(prepared: Path, dst: Path, with_alignment: bool = False) -> Path:
    copy_prepared(prepared / "run", dst)
    if with_alignment:
        shutil.copytree(prepared / "run" / "alignment", dst / "alignment")
    return dst


def _assert_same_gradients(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-7, msg=name)


def test_alignment_micro_batches_give_the_gradients_and_loss_of_one_big_batch(prepared, tmp_path):
    whole = write_recipe(tmp_path / "whole.yaml", stages__alignment__batch_size=4)
    micro = write_recipe(tmp_path / "micro.yaml", stages__alignment__batch_size=4,
                         stages__alignment__micro_batch_size=1)
    rec_a, grads_a, _ = _one_step(whole, _fresh(prepared, tmp_path / "a"), "alignment")
    rec_b, grads_b, _ = _one_step(micro, _fresh(prepared, tmp_path / "b"), "alignment")
    assert rec_a["label_tokens"] == rec_b["label_tokens"] and rec_a["tokens"] == rec_b["tokens"]
    assert rec_a["loss"] == pytest.approx(rec_b["loss"], rel=1e-5)
    _assert_same_gradients(grads_a, grads_b)


def test_sft_micro_batches_that_do_not_divide_the_batch_still_equal_one_big_batch(prepared, tmp_path):
    whole = write_recipe(tmp_path / "whole.yaml", stages__sft__batch_size=3)
    micro = write_recipe(tmp_path / "micro.yaml", stages__sft__batch_size=3, stages__sft__micro_batch_size=2)
    rec_a, grads_a, _ = _one_step(whole, _fresh(prepared, tmp_path / "a", True), "sft")
    rec_b, grads_b, _ = _one_step(micro, _fresh(prepared, tmp_path / "b", True), "sft")
    assert rec_a["loss"] == pytest.approx(rec_b["loss"], rel=1e-5)
    assert any("lora_" in n for n in grads_a)  # the adapter's gradients are compared too
    _assert_same_gradients(grads_a, grads_b)


def test_dpo_micro_batches_of_pairs_give_the_gradients_of_all_pairs_at_once(sft_run, tmp_path):
    runs = []
    for name, extra in (("whole", {}), ("micro", {"stages__dpo__micro_batch_size": 1})):
        run = tmp_path / name
        shutil.copytree(sft_run, run)
        runs.append(_one_step(write_recipe(tmp_path / f"{name}.yaml", stages__dpo__pairs_per_step=3, **extra),
                              run, "dpo"))
    (rec_a, grads_a, _), (rec_b, grads_b, _) = runs
    assert rec_a["loss"] == pytest.approx(rec_b["loss"], rel=1e-5)
    assert rec_a["margin"] == pytest.approx(rec_b["margin"], rel=1e-4, abs=1e-7)
    _assert_same_gradients(grads_a, grads_b)


def test_full_activation_checkpointing_recomputes_layers_and_gives_the_same_gradients(prepared, tmp_path):
    off = write_recipe(tmp_path / "off.yaml", stages__alignment__batch_size=2)
    full = write_recipe(tmp_path / "full.yaml", stages__alignment__batch_size=2,
                        stages__alignment__activation_checkpointing="full")
    rec_a, grads_a, ctx_a = _one_step(off, _fresh(prepared, tmp_path / "a"), "alignment")
    calls = []
    recipe = load_recipe(full)
    # count the calls of each layer's first submodule over one step: a checkpointed layer runs it twice (transformers
    # recomputes the layer's forward; from 5.24 its __call__ hooks stay outside the checkpoint, its children's do not)
    with ExitStack() as cleanup:
        ctx = setup(recipe, "alignment", _fresh(prepared, tmp_path / "b"), cleanup, resume=False,
                    progress=False, registry=get_host())
        layers = decoder_layers(ctx.model)
        assert layers and all(layer.gradient_checkpointing for layer in layers)
        hooks = [next(layer.children()).register_forward_pre_hook(lambda *_: calls.append(1)) for layer in layers]
        ctx.model.train()
        ctx.runner.start(ctx)
        ctx.runner.step(ctx)
        for hook in hooks:
            hook.remove()
    assert len(calls) == 2 * len(layers)
    assert not any(layer.gradient_checkpointing for layer in decoder_layers(ctx_a.model))
    rec_b, grads_b, _ = _one_step(full, _fresh(prepared, tmp_path / "c"), "alignment")
    assert rec_a["loss"] == pytest.approx(rec_b["loss"], rel=1e-6)
    _assert_same_gradients(grads_a, grads_b)


def test_selective_checkpointing_covers_only_the_named_layer_kinds_of_a_hybrid_model(prepared, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", model="qwen3.5-tiny",
                          stages__alignment__activation_checkpointing=["linear_attention"])
    with ExitStack() as cleanup:
        ctx = setup(load_recipe(recipe), "alignment", _fresh(prepared, tmp_path / "a"), cleanup, resume=False,
                    progress=False, registry=get_host())
        layers = decoder_layers(ctx.model)
        kinds = {layer_kind(layer) for layer in layers}
        assert kinds == {"linear_attention", "full_attention"}
        assert all(layer.gradient_checkpointing == (layer_kind(layer) == "linear_attention") for layer in layers)


def test_checkpointing_a_layer_kind_the_model_lacks_is_refused_naming_the_kinds_it_has(prepared, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", stages__alignment__activation_checkpointing=["moe"])
    with ExitStack() as cleanup, pytest.raises(CheckpointingError, match=r"stages\.alignment.*'moe'.*full_attention"):
        setup(load_recipe(recipe), "alignment", _fresh(prepared, tmp_path / "a"), cleanup, resume=False,
              progress=False, registry=get_host())


@pytest.mark.parametrize("value", [[], ["moe", "moe"], "some", 3])
def test_activation_checkpointing_values_are_checked_when_the_recipe_loads(tmp_path, value):
    with pytest.raises(RecipeError, match="activation_checkpointing"):
        load_recipe(write_recipe(tmp_path / "r.yaml", stages__sft__activation_checkpointing=value))


def test_a_micro_batch_size_of_zero_is_refused_when_the_recipe_loads(tmp_path):
    with pytest.raises(RecipeError, match="micro_batch_size"):
        load_recipe(write_recipe(tmp_path / "r.yaml", stages__alignment__micro_batch_size=0))
