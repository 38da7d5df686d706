"""A run trained from a recipe's model.snapshot is served, exported, warm-started and rolled out (Ray workers) from
that same snapshot, checked by its fingerprint: a snapshot whose weights differ from the preset's proves which one
each consumer read, and a moved or replaced snapshot is refused naming its path. Ray workers' sampling is seeded
per call, so a step's samples do not depend on the steps before it."""

from __future__ import annotations

import datetime
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from stitch.config.recipe import load_recipe
from stitch.host.host import get_host
from stitch.model.artifacts import ArtifactError
from stitch.model.loading import SnapshotError
from stitch.stages.loop import run_stage
from tests.stitch_testing import copy_prepared, write_recipe

MODEL = "qwen3.5-demo"  # the tests' default base (stitch_testing.BASE)
EMBED = "model.embed_tokens.weight"  # no LoRA target: after a merge it is still the base's tensor


def _preset_dir(host) -> Path:
    from stitch.plugins.snapshot_cache import ensure_snapshot

    spec = host.get("models", MODEL)
    return ensure_snapshot(spec.source.builder_key, spec.source.builder)


@pytest.fixture(scope="module")
def snap_run(prepared, tmp_path_factory):
    """The preset's snapshot copied with every weight perturbed (same config and tokenizer, other weights), and a
    1-step alignment + 1-step SFT run trained from it through ``model: {name, snapshot}``."""
    from stitch.host.host import load_plugins

    root = tmp_path_factory.mktemp("snap-run")
    preset = _preset_dir(load_plugins())
    snap = root / "snapshot"
    shutil.copytree(preset, snap)
    gen = torch.Generator().manual_seed(7)
    weights = {k: (v + 0.05 * torch.randn(v.shape, generator=gen, dtype=v.dtype) if v.is_floating_point() else v)
               for k, v in load_file(preset / "model.safetensors").items()}
    save_file(weights, snap / "model.safetensors", metadata={"format": "pt"})
    run = root / "run"
    copy_prepared(prepared / "run", run)
    recipe = load_recipe(write_recipe(root / "snap.yaml", model={"name": MODEL, "snapshot": str(snap)}),
                         overrides=["stages.alignment.steps=1", "stages.sft.steps=1"])
    run_stage(recipe, "alignment", run, progress=False, registry=get_host())
    run_stage(recipe, "sft", run, progress=False, registry=get_host())
    return {"run": run, "snap": snap.resolve(), "preset": preset, "recipe": recipe}


def _embeds(directory: Path) -> torch.Tensor:
    return load_file(directory / "model.safetensors")[EMBED]


def test_the_artifact_records_the_snapshot_path_and_fingerprint_it_was_trained_from(snap_run, host):
    from stitch.model.loading import snapshot_fingerprint

    manifest = json.loads(next((snap_run["run"] / "sft").rglob("projector/manifest.json")).read_text())
    assert manifest["base_model_snapshot"] == str(snap_run["snap"])
    assert manifest["base_model_fingerprint"] == snapshot_fingerprint(snap_run["snap"])
    assert manifest["base_model_fingerprint"] != snapshot_fingerprint(snap_run["preset"])  # the weights differ


def test_a_served_checkpoint_loads_the_base_from_the_recorded_snapshot_not_the_preset(snap_run):
    from stitch.serve.inference import Stitched

    served = Stitched(snap_run["run"] / "sft" / "checkpoints", device="cpu", registry=get_host())
    assert served.binding.snapshot == snap_run["snap"]
    live = served.model.lm.get_input_embeddings().weight.detach()
    assert torch.equal(live, _embeds(snap_run["snap"]))
    assert not torch.equal(live, _embeds(snap_run["preset"]))


def test_export_merges_the_adapter_into_the_recorded_snapshot_not_the_preset(snap_run, tmp_path):
    from stitch.serve.export import export_checkpoint

    manifest = export_checkpoint(snap_run["run"] / "sft" / "checkpoints", tmp_path / "export", registry=get_host())
    exported = load_file(tmp_path / "export" / "model" / "model.safetensors")[EMBED]
    assert torch.equal(exported, _embeds(snap_run["snap"]))
    assert not torch.equal(exported, _embeds(snap_run["preset"]))
    assert manifest["base_model_source"]["base_model_snapshot"] == str(snap_run["snap"])


def test_a_moved_snapshot_is_refused_at_serve_and_export_naming_its_path_before_any_weights_load(
        snap_run, tmp_path, monkeypatch):
    import stitch.model.loading as loading
    from stitch.serve.export import export_checkpoint
    from stitch.serve.inference import Stitched

    def no_weights(*args, **kwargs):
        raise AssertionError("base weights were read before the snapshot check")

    monkeypatch.setattr(loading, "load_model", no_weights)
    moved = snap_run["snap"].with_name("moved-away")
    snap_run["snap"].rename(moved)
    try:
        for consume in (lambda c: Stitched(c, device="cpu", registry=get_host()), lambda c: export_checkpoint(c, tmp_path / "export", registry=get_host())):
            with pytest.raises(SnapshotError) as refused:
                consume(snap_run["run"] / "sft" / "checkpoints")
            assert str(snap_run["snap"]) in str(refused.value) and "not there any more" in str(refused.value)
    finally:
        moved.rename(snap_run["snap"])
    assert not (tmp_path / "export").exists()


def test_a_snapshot_whose_weights_were_replaced_is_refused_by_its_fingerprint(snap_run):
    from stitch.serve.inference import Stitched

    weights = snap_run["snap"] / "model.safetensors"
    kept = weights.with_name("kept.safetensors.bak")
    weights.rename(kept)
    shutil.copy(snap_run["preset"] / "model.safetensors", weights)  # same names and shapes, the preset's values
    try:
        with pytest.raises(ArtifactError, match="field 'base_model_fingerprint' expected"):
            Stitched(snap_run["run"] / "sft" / "checkpoints", device="cpu", registry=get_host())
    finally:
        kept.replace(weights)


def test_the_warm_start_gate_refuses_a_donor_trained_on_another_snapshot_of_the_same_model(snap_run, host):
    from stitch.model.binding import ModelBinding
    from stitch.model.provenance import ProvenanceError, check_warm_start
    from stitch.runs.checkpoint import latest_step_dir
    from stitch.stages.loop import stage_options

    recipe = snap_run["recipe"]
    donor = latest_step_dir(snap_run["run"] / "sft" / "checkpoints")
    lora = stage_options(recipe, "sft").lora
    check_warm_start(donor, ModelBinding.for_recipe(recipe, registry=host).warm_start_expectations(lora))  # same base
    preset = ModelBinding.resolve(host, MODEL, recipe.encoder, recipe.projector)  # same name, the preset's weights
    with pytest.raises(ProvenanceError, match="field 'base_model_fingerprint'"):
        check_warm_start(donor, preset.warm_start_expectations(lora))


# -- Ray rollout workers (the worker class, driven directly: no Ray cluster) ---------------------------------


def _eos(host) -> int:
    from stitch.model.loading import load_tokenizer

    return load_tokenizer(host.get("models", MODEL)).eos_token_id


def _worker(rank: int, snapshot: Path | None, host):
    from stitch.rollout.ray_rollout import RolloutWorker, worker_specs

    return RolloutWorker(rank, engine="embedded", model=MODEL, specs=worker_specs(host, "embedded", MODEL), dtype="float32", pad_id=0, eos_id=_eos(host),
                         suppress_ids=[], engine_config=None, vocab_size=None, env={}, seed=0,
                         snapshot=None if snapshot is None else str(snapshot))


def _feed(worker, state: dict[str, torch.Tensor]) -> None:
    """What RayRolloutEngine does for the initial weights: a 2-rank gloo group, one broadcast of ``state``."""
    import torch.distributed as dist

    from stitch.rollout.ray_rollout import broadcast_state_dict, manifest_of, new_group

    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timeout, wait_for_workers=False)
    manifest = manifest_of(state)

    def side():
        worker.join("127.0.0.1", store.port, 2, "gloo", 60)
        worker.receive(manifest)

    thread = threading.Thread(target=side)
    thread.start()
    broadcast_state_dict(new_group(store, 0, 2, "gloo", timeout), state, manifest, torch.device("cpu"))
    thread.join(timeout=60)


def test_a_ray_worker_loads_the_policys_snapshot_and_refuses_to_run_on_another_base(snap_run, host):
    from stitch.model.loading import snapshot_fingerprint
    from stitch.rollout.ray_rollout import check_worker_bases
    from stitch.rollout.vllm_engine import RefitError

    worker = _worker(1, snap_run["snap"], host)
    assert torch.equal(worker.lm.state_dict()[EMBED], _embeds(snap_run["snap"]))
    info = worker.describe()
    assert info["base_fingerprint"] == snapshot_fingerprint(snap_run["snap"])
    check_worker_bases([info], MODEL, snap_run["snap"], snapshot_fingerprint(snap_run["snap"]))
    preset_info = {**info, "base_fingerprint": snapshot_fingerprint(snap_run["preset"])}
    with pytest.raises(RefitError, match=r"rollout worker 1 loaded model 'qwen3.5-demo' from the local snapshot"):
        check_worker_bases([preset_info], MODEL, snap_run["snap"], snapshot_fingerprint(snap_run["snap"]))


def test_a_ray_workers_samples_at_a_step_are_the_same_whether_or_not_earlier_steps_ran(host):
    from stitch.rollout.engines import sampling_seed

    worker = _worker(1, None, host)
    try:
        _feed(worker, {k: v.clone() for k, v in worker.lm.state_dict().items()})
        gen = torch.Generator().manual_seed(3)
        prompts = [torch.randn(5, worker.lm.config.hidden_size, generator=gen) for _ in range(2)]

        def step(k: int) -> list[list[int]]:
            return [c.token_ids for c in worker.generate(prompts, 4, 8, temperature=1.0,
                                                         seed=sampling_seed(0, "rollout", k))]

        fresh = step(2)  # as after a kill -9 and --resume at step 2: nothing sampled before in this worker
        step(0), step(1)
        assert step(2) == fresh  # after steps 0 and 1 ran
        assert step(1) != fresh  # not a constant: another step samples otherwise
    finally:
        worker.close()


def test_the_embedded_engine_samples_from_the_seed_alone_and_leaves_the_trainers_rng_as_it_was(host):
    from stitch.model.loading import load_model
    from stitch.rollout.engines import EmbeddedEngine

    lm = load_model(host.get("models", MODEL), registry=get_host()).eval()
    engine = EmbeddedEngine(lm, pad_id=0, eos_id=_eos(host))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randn(5, lm.config.hidden_size, generator=gen) for _ in range(2)]
    first = [c.token_ids for c in engine.generate(prompts, 4, 8, seed=11)]
    torch.rand(100)  # the trainer's stream moves on
    before = torch.get_rng_state()
    assert [c.token_ids for c in engine.generate(prompts, 4, 8, seed=11)] == first
    assert torch.equal(torch.get_rng_state(), before)
    assert [c.token_ids for c in engine.generate(prompts, 4, 8, seed=12)] != first
