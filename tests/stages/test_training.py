"""Alignment and SFT: exact resume after SIGKILL, packing, the gradient audit, every tiny architecture."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stitch.config.options import LoraOptions
from stitch.config.recipe import load_recipe
from stitch.data.packing import PackedStream, collate_packs
from stitch.host.host import get_host
from stitch.stages.loop import audit_gradients, run_stage
from tests.stitch_testing import cli, copy_prepared, kill_after_checkpoint, write_recipe


def _losses(run: Path, stage: str) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / stage / "metrics.jsonl").read_text().splitlines()]


def test_sft_killed_midway_resumes_to_identical_losses_and_weights(prepared, tmp_path):
    env = dict(os.environ)  # default intra-op threads: resume is bitwise without pinning one thread
    recipe_path = write_recipe(tmp_path / "r.yaml", stages__sft__steps=6, stages__sft__save_every=3)
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    for run in (straight, killed):
        copy_prepared(prepared / "run", run)
        (run / "alignment").mkdir(parents=True)
        import shutil

        shutil.copytree(prepared / "run" / "alignment" / "checkpoints", run / "alignment" / "checkpoints")
    subprocess.run(cli("train", "sft", "--recipe", str(recipe_path), "--out", str(straight)), check=True,
                   capture_output=True, env=env)
    kill_after_checkpoint(cli("train", "sft", "--recipe", str(recipe_path), "--out", str(killed)),
                          killed / "sft" / "checkpoints", 3, env)
    assert not (killed / "sft" / "checkpoints" / "step_6").exists(), "killed too late to test a resume"
    subprocess.run(cli("train", "sft", "--recipe", str(recipe_path), "--out", str(killed), "--resume"),
                   check=True, capture_output=True, env=env)
    assert _losses(killed, "sft") == _losses(straight, "sft")  # bitwise: same floats, same order
    for part in ("adapter/adapter_model.safetensors", "projector/mm-projector.safetensors"):
        a = load_file(str(straight / "sft" / "checkpoints" / "step_6" / part))
        b = load_file(str(killed / "sft" / "checkpoints" / "step_6" / part))
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), part


def test_resume_without_a_checkpoint_is_refused(prepared, tmp_path):
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml"))
    copy_prepared(prepared / "run", tmp_path / "run")
    with pytest.raises(FileNotFoundError, match="LATEST"):
        run_stage(recipe, "alignment", tmp_path / "run", resume=True, progress=False, registry=get_host())


def _stream(session, budget: int, pack: bool) -> PackedStream:
    return PackedStream(session.manifest_path, session.make_sample, token_budget=budget, buffer_size=32, seed=0,
                        pack=pack, rows=lambda row: row["partition"] == "train")


def test_packs_fill_at_least_90_percent_of_the_token_budget(prepared, tmp_path):
    from stitch.stages.session import StitchSession

    recipe = load_recipe(write_recipe(tmp_path / "r.yaml"))
    session = StitchSession.open(recipe, prepared / "run", registry=get_host())
    stream = _stream(session, 512, pack=True)
    packs = [stream.next_pack() for _ in range(40)]
    fill = sum(sum(len(s) for s in p) for p in packs) / (40 * 512)
    assert fill >= 0.90, fill
    batch = collate_packs(packs[:2], session.pad_id, packed=True, length=512)
    # position ids restart at every sample boundary
    starts = int((batch.position_ids == 0).sum())
    assert starts >= sum(len(p) for p in packs[:2])
    assert batch.features.shape[0] == sum(len(p) for p in packs[:2])


def test_packed_batch_loss_equals_unpacked_loss_of_the_same_samples(prepared, tmp_path):
    from stitch.stages.session import StitchSession

    recipe = load_recipe(write_recipe(tmp_path / "r.yaml"))
    session = StitchSession.open(recipe, prepared / "run", registry=get_host())
    model = session.binding.build_model(lora=LoraOptions(r=4, alpha=8))
    torch.manual_seed(1)
    with torch.no_grad():  # a nonzero adapter and projector, so the check covers them
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.05)
    pack = _stream(session, 512, pack=True).next_pack()
    assert len(pack) >= 3
    packed = collate_packs([pack], session.pad_id, packed=True, length=512)
    unpacked = collate_packs([[s] for s in pack], session.pad_id, packed=False)
    with torch.no_grad():
        lp, n_p = model.loss(packed)
        lu, n_u = model.loss(unpacked)
    assert n_p == n_u
    assert torch.allclose(lp, lu, atol=1e-5, rtol=1e-5), (float(lp), float(lu))


@pytest.mark.parametrize("model, graphed", [("qwen3.5-tiny", True), ("nemotron-nano-tiny", False)])
def test_a_models_spec_decides_whether_its_lora_layers_may_run_as_cuda_graphs(prepared, tmp_path, model, graphed):
    """ModelSpec.cuda_graphs reaches the built model: Nemotron-H's blocks stay eager (its packed GPU step ran slower
    graphed), Qwen's may be captured."""
    from stitch.kernels import graphs
    from stitch.stages.session import StitchSession

    session = StitchSession.open(load_recipe(write_recipe(tmp_path / "r.yaml", model=model)), prepared / "run", registry=get_host())
    built = session.binding.build_model(lora=LoraOptions(r=4))
    loras = [m for m in built.modules() if hasattr(m, "lora_A")]  # and every other block the model has
    assert loras and all((m in graphs._EAGER) is not graphed for m in built.modules())


def test_gradient_audit_refuses_a_trainable_lm_weight(prepared, tmp_path):
    from stitch.stages.session import StitchSession

    recipe = load_recipe(write_recipe(tmp_path / "r.yaml"))
    session = StitchSession.open(recipe, prepared / "run", registry=get_host())
    model = session.binding.build_model()
    audit_gradients(model, ("projector",))
    model.lm.get_input_embeddings().weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="embed_tokens"):
        audit_gradients(model, ("projector",))


@pytest.mark.parametrize("model", ["qwen3.5-tiny", "qwen3.5-moe-tiny", "nemotron-nano-tiny", "nemotron-lightning-tiny"])
def test_alignment_and_sft_run_on_each_tiny_architecture(prepared, tmp_path, model):
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", model=model))
    copy_prepared(prepared / "run", tmp_path / "run")
    align = run_stage(recipe, "alignment", tmp_path / "run", progress=False, registry=get_host())
    sft = run_stage(recipe, "sft", tmp_path / "run", progress=False, registry=get_host())
    assert align["trainable_parameters"]["adapter"] == 0 and align["trainable_parameters"]["lm"] == 0
    assert sft["trainable_parameters"]["adapter"] > 0 and sft["trainable_parameters"]["lm"] == 0
    assert not sft["packed"]  # hybrid layers would leak state across packed samples
    step = Path(sft["checkpoint"])
    config = json.loads((step / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(get_host().get("models", model).lora_target_modules)
    assert all(torch.isfinite(torch.tensor(_losses(tmp_path / "run", "sft"))))
    for summary in (align, sft):  # the frozen LM, the trained projector and adapters: held as estimated
        assert summary["memory_held_bytes"] == summary["memory_estimate"]["bytes"]


@pytest.mark.parametrize("field, changed", [("pack", {"pack": False}), ("token_budget", {"token_budget": 256})])
def test_resume_refuses_a_data_stream_that_would_batch_differently(tmp_path, field, changed):
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text("".join(json.dumps({"id": f"r{i}", "partition": "train"}) + "\n" for i in range(4)))
    options = {"token_budget": 512, "pack": True}
    state = PackedStream(manifest, lambda row: None, **options).state_dict()
    resumed = PackedStream(manifest, lambda row: None, **{**options, **changed})
    with pytest.raises(ValueError, match=f"{field}="):
        resumed.load_state_dict(state)
    PackedStream(manifest, lambda row: None, **options).load_state_dict(state)  # same settings: accepted


@pytest.mark.parametrize("argv", [["train", "sft", "--recipe", "R.yaml"], ["prepare", "--recipe", "R.yaml"],
                                  ["run", "R.yaml"]], ids=["train", "prepare", "run"])
def test_cli_passes_trailing_key_value_overrides_to_the_recipe_loader(monkeypatch, argv):
    from typer.testing import CliRunner

    from stitch.cli import app

    calls = []

    class Loaded(Exception):
        pass

    def fake_load(recipe, registry=None, **kwargs):
        calls.append((recipe, kwargs))
        raise Loaded

    monkeypatch.setattr("stitch.cli.stages.load_recipe", fake_load)
    result = CliRunner().invoke(app, [*argv, "stages.sft.steps=3", "seed=1"])
    assert isinstance(result.exception, Loaded), result.output
    assert calls == [("R.yaml", {"overrides": ["stages.sft.steps=3", "seed=1"]})]
    CliRunner().invoke(app, argv)  # none given: the loader gets no override
    assert calls[-1][0] == "R.yaml" and not calls[-1][1].get("overrides")


def test_stage_options_are_typed_coerced_and_refused_by_field_path(tmp_path):
    from stitch.config.options import GRPOOptions
    from stitch.config.recipe import RecipeError
    from stitch.stages.loop import stage_options

    recipe = load_recipe(write_recipe(tmp_path / "ok.yaml", stages__grpo__lr_adapter="1e-4"))
    opts = stage_options(recipe, "grpo")
    assert isinstance(opts, GRPOOptions) and opts.lr_adapter == 1e-4  # YAML's "1e-4" string is a float
    assert stage_options(recipe, "grpo") == opts and stage_options(recipe, "sft").lora.r == 16
    with pytest.raises(RecipeError, match=r"'stages\.sft\.lora\.rank'"):  # at load once recipes are typed
        stage_options(load_recipe(write_recipe(tmp_path / "bad.yaml", stages__sft__lora={"rank": 8})), "sft")
