"""Prepared feature shards record their sha256 when written and are verified before use: a tampered shard is
refused, naming it, by training reads and by a re-run of prepare."""

from __future__ import annotations

import json

import pytest

from stitch.config.recipe import load_recipe
from stitch.data.feature_cache import FeatureCacheError, PreparedData, shard_digest_path
from tests.stitch_testing import prepare_resolved, write_recipe


@pytest.fixture
def prepared_small(tmp_path):
    recipe = load_recipe(write_recipe(
        tmp_path / "r.yaml", data__source__rows=12, data__source__caption_rows=0, data__scan_cap=16,
        data__partitions={"alignment": [0, 4], "train": [4, 8], "eval": [8, 10], "grpo": [10, 12]}))
    out = tmp_path / "run" / "data"
    prepare_resolved(recipe, out, progress=False)
    return recipe, out


def _tamper(shard) -> None:
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # a byte of tensor data, past the safetensors header
    shard.write_bytes(bytes(data))


def test_every_manifest_key_carries_the_sha256_its_shard_was_written_with(prepared_small):
    _, out = prepared_small
    rows = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    for row in rows:
        for key in row["features"]:
            shard = out / "feature-cache" / key["shard"]
            assert key["sha256"] == shard_digest_path(shard).read_text().strip()


def test_a_tampered_shard_is_refused_by_training_reads_naming_it(prepared_small):
    _, out = prepared_small
    data = PreparedData(out)
    row = next(iter(data.rows("train")))
    shard = out / "feature-cache" / row.features[0].shard
    _tamper(shard)
    with pytest.raises(FeatureCacheError, match=rf"{shard.name}.*modified"):
        PreparedData(out).features(row)


def test_a_tampered_shard_is_refused_when_prepare_would_reuse_it(prepared_small):
    recipe, out = prepared_small
    shard = next((out / "feature-cache").glob("*.safetensors"))
    _tamper(shard)
    with pytest.raises(FeatureCacheError, match=rf"{shard.name} was modified"):
        prepare_resolved(recipe, out, progress=False)


def test_every_checkpoint_records_the_sha256_of_each_file_it_wrote(sft_run):
    from stitch.runs.checkpoint import CHECKSUMS, latest_step_dir

    step = latest_step_dir(sft_run / "sft" / "checkpoints")
    recorded = json.loads((step / CHECKSUMS).read_text())
    written = {str(p.relative_to(step)) for p in step.rglob("*") if p.is_file() and p.name != CHECKSUMS}
    assert set(recorded) == written
    assert {"adapter/adapter_model.safetensors", "projector/mm-projector.safetensors", "optimizer.pt",
            "trainer_state.json"} <= written


def test_a_tampered_checkpoint_is_refused_naming_the_file_before_inference_loads_it(sft_run, tmp_path):
    import shutil

    from stitch.runs.checkpoint import CheckpointIntegrityError
    from stitch.serve.inference import resolve_checkpoint

    copy = tmp_path / "checkpoints"
    shutil.copytree(sft_run / "sft" / "checkpoints", copy)
    resolve_checkpoint(copy)  # intact: accepted
    step = next(p for p in copy.iterdir() if p.is_dir())
    _tamper(step / "adapter" / "adapter_model.safetensors")
    with pytest.raises(CheckpointIntegrityError, match=r"adapter/adapter_model\.safetensors has sha256 .* modified"):
        resolve_checkpoint(step)


def test_a_checkpoint_whose_checksum_record_was_deleted_is_refused(sft_run, tmp_path):
    import shutil

    from stitch.runs.checkpoint import CHECKSUMS, CheckpointIntegrityError, latest_step_dir
    from stitch.serve.inference import resolve_checkpoint

    copy = tmp_path / "checkpoints"
    shutil.copytree(sft_run / "sft" / "checkpoints", copy)
    step = latest_step_dir(copy)
    (step / CHECKSUMS).unlink()
    _tamper(step / "adapter" / "adapter_model.safetensors")  # unchecked, this would now load
    with pytest.raises(CheckpointIntegrityError, match=f"{CHECKSUMS} is missing"):
        resolve_checkpoint(step)
