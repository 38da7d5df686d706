"""SFT with ``train_lm: full``: every LM weight (or only the named layers) trains and is checkpointed beside the
projector; a SIGKILLed run resumes bitwise; serving and export use the trained weights; the training state's memory
estimate is in the summary, and a stage that cannot fit its declared device memory is refused with the arithmetic."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from stitch.config.recipe import load_recipe
from stitch.host.host import get_host
from stitch.model.binding import ModelBinding
from stitch.model.lm_weights import LmSelectionError
from stitch.model.memory import TrainingMemoryError
from stitch.serve.export import export_checkpoint
from stitch.serve.inference import Stitched
from stitch.stages.loop import run_stage
from tests.stitch_testing import cli, kill_after_checkpoint, write_recipe

STEPS, SAVE_EVERY = 6, 3
FULL = {"stages__sft__train_lm": "full", "stages__sft__lr_lm": 1e-3, "stages__grpo": None, "stages__dpo": None,
        "stages__sft__steps": STEPS, "stages__sft__save_every": SAVE_EVERY}


def _run_dir(prepared: Path, into: Path) -> Path:
    """A run directory with the prepared data and the alignment checkpoint SFT warm-starts from."""
    shutil.copytree(prepared / "run", into, ignore=shutil.ignore_patterns("sft"))
    return into


def _records(run: Path) -> list[dict]:
    lines = (run / "sft" / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not (k.endswith("_s") or k == "tokens_per_s")}
            for line in lines]


def _base_lm_state(recipe_path: Path) -> dict[str, torch.Tensor]:
    binding = ModelBinding.for_recipe(load_recipe(recipe_path), get_host(), device="cpu")
    return {name: p.detach().clone() for name, p in binding.load_lm().named_parameters()}


@pytest.fixture(scope="module")
def full_sft(prepared, tmp_path_factory):
    """An uninterrupted 6-step full fine-tune (checkpoints at steps 3 and 6) and its recipe."""
    root = tmp_path_factory.mktemp("full-sft")
    recipe_path = write_recipe(root / "full.yaml", **FULL)
    run = _run_dir(prepared, root / "run")
    summary = run_stage(load_recipe(recipe_path), "sft", run, progress=False, registry=get_host())
    return recipe_path, run, summary


def test_full_sft_trains_and_checkpoints_every_lm_weight_and_no_adapter(full_sft):
    recipe_path, run, summary = full_sft
    base = _base_lm_state(recipe_path)
    step = Path(summary["checkpoint"])
    saved = load_file(str(step / "lm" / "model.safetensors"))
    assert sorted(saved) == sorted(base)  # every LM weight (tied ones once) is saved
    unchanged = [name for name in base if torch.equal(saved[name], base[name])]
    assert not unchanged, f"weights that did not train: {unchanged}"
    assert not (step / "adapter").exists()
    lm_elements = sum(t.numel() for t in base.values())
    assert summary["trainable_parameters"]["lm"] == lm_elements and summary["trainable_parameters"]["adapter"] == 0
    projector = summary["trainable_parameters"]["projector"]
    # fp32 throughout: weights, gradients and AdamW's two moments, 4 bytes each, for the LM and the projector
    assert summary["memory_estimate"]["bytes"] == 16 * (lm_elements + projector)
    assert f"{lm_elements:,} x 8 B" in summary["memory_estimate"]["arithmetic"]
    # and the state the first optimizer step held is what the estimate said, byte for byte
    assert summary["memory_held_bytes"] == summary["memory_estimate"]["bytes"]


def test_full_sft_killed_midway_resumes_to_identical_metrics_and_lm_weights(full_sft, prepared, tmp_path):
    recipe_path, straight, _ = full_sft
    killed = _run_dir(prepared, tmp_path / "killed")
    train = cli("train", "sft", "--recipe", str(recipe_path), "--out", str(killed))
    # the killed process runs with the thread count of the uninterrupted one (this process, at fixture time)
    written = json.loads((straight / "sft" / "checkpoints" / f"step_{SAVE_EVERY}" / "trainer_state.json").read_text())
    env = {**os.environ, "OMP_NUM_THREADS": str(written["intra_op_threads"])}
    kill_after_checkpoint(train, killed / "sft" / "checkpoints", SAVE_EVERY, env)
    assert not (killed / "sft" / "checkpoints" / f"step_{STEPS}").exists(), "killed too late to test a resume"
    run_stage(load_recipe(recipe_path), "sft", killed, resume=True, progress=False, registry=get_host())
    assert _records(killed) == _records(straight)  # every logged float, bitwise
    for part in ("lm/model.safetensors", "projector/mm-projector.safetensors"):
        a = load_file(str(straight / "sft" / "checkpoints" / f"step_{STEPS}" / part))
        b = load_file(str(killed / "sft" / "checkpoints" / f"step_{STEPS}" / part))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part


def test_full_sft_checkpoint_is_served_by_stitch_infer_and_exported_with_its_trained_lm_weights(full_sft, tmp_path):
    recipe_path, run, summary = full_sft
    step = Path(summary["checkpoint"])
    trained = load_file(str(step / "lm" / "model.safetensors"))
    served = Stitched(run / "sft" / "checkpoints", get_host(), device="cpu")
    lm_state = dict(served.model.lm.named_parameters())
    assert served.merged_weights == 0 and all(torch.equal(lm_state[k], v) for k, v in trained.items())
    image = tmp_path / "a.png"
    Image.new("RGB", (224, 224), (200, 40, 40)).save(image)
    question = "How many shapes are in the image?"
    infer = subprocess.run(cli("infer", "--adapter", str(run / "sft" / "checkpoints"), "--media", str(image),
                               "--question", question, "--max-new-tokens", "6"),
                           check=True, capture_output=True, text=True)
    assert infer.stdout == served.answer([str(image)], question, max_new_tokens=6) + "\n"  # `stitch infer` serves it
    export_checkpoint(step, tmp_path / "export", get_host())
    exported = {}
    for shard in (tmp_path / "export" / "model").glob("*.safetensors"):
        exported.update(load_file(str(shard)))
    assert all(torch.equal(exported[k], v) for k, v in trained.items() if k in exported)
    assert "model.layers.0.mlp.down_proj.weight" in exported


def test_train_lm_layers_trains_only_the_named_layers_and_a_tied_head_by_either_name(prepared, tmp_path):
    layers = [1, "model.norm.*", "lm_head.weight"]  # the demo LM ties lm_head.weight to model.embed_tokens.weight
    recipe_path = write_recipe(tmp_path / "r.yaml", **{**FULL, "stages__sft__steps": 1, "stages__sft__save_every": 1,
                                                       "stages__sft__train_lm_layers": layers})
    run = _run_dir(prepared, tmp_path / "run")
    summary = run_stage(load_recipe(recipe_path), "sft", run, progress=False, registry=get_host())
    saved = load_file(str(Path(summary["checkpoint"]) / "lm" / "model.safetensors"))
    named = ("model.norm.weight", "model.embed_tokens.weight")
    assert sorted(saved) == sorted(k for k in _base_lm_state(recipe_path)
                                   if k.startswith("model.layers.1.") or k in named)
    assert summary["trainable_parameters"]["lm"] == sum(t.numel() for t in saved.values())


@pytest.mark.parametrize(("layers", "message"), [
    (["model.layers.9.*"], r"stages\.sft\.train_lm_layers: 'model\.layers\.9\.\*' matches none of the LM's"),
    ([7], r"stages\.sft\.train_lm_layers: layer 7 is not in this model; its decoder has 2 layers"),
])
def test_train_lm_layers_naming_nothing_in_the_model_is_refused_naming_it(prepared, tmp_path, layers, message):
    recipe_path = write_recipe(tmp_path / "r.yaml", **{**FULL, "stages__sft__train_lm_layers": layers})
    run = _run_dir(prepared, tmp_path / "run")
    with pytest.raises(LmSelectionError, match=message):
        run_stage(load_recipe(recipe_path), "sft", run, progress=False, registry=get_host())
    assert not (run / "sft" / "checkpoints" / "LATEST").exists()


def test_stage_whose_training_state_exceeds_the_declared_memory_is_refused_with_the_arithmetic(prepared, tmp_path):
    recipe_path = write_recipe(tmp_path / "r.yaml", **{**FULL, "stages__sft__device_memory_gib": 0.0001})
    run = _run_dir(prepared, tmp_path / "run")
    with pytest.raises(TrainingMemoryError, match=r"lm weights \(float32, trained\) [\d,]+ x 4 B = .*lm AdamW "
                                                  r"moments \(2 x float32\) [\d,]+ x 8 B = .*stages\.sft\."
                                                  r"device_memory_gib: 0\.0001 GiB: does not fit"):
        run_stage(load_recipe(recipe_path), "sft", run, progress=False, registry=get_host())
    assert not (run / "sft" / "checkpoints" / "LATEST").exists()
