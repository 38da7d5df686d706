"""The projector artifact codec: round trip, provenance gate, checksums, atomic writes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from stitch.model.artifacts import (
    MANIFEST_NAME,
    PROVENANCE_FIELDS,
    WEIGHTS_NAME,
    ArtifactError,
    load_projector_artifact,
    save_projector_artifact,
)
from stitch.model.projector import MLP2xGeluProjector

PROVENANCE = {
    "encoder": "clip-tiny",
    "encoder_id": "openai/clip-vit-base-patch32",
    "encoder_revision": "3d74acf9a28c67741b2f4f2ea7635f0aaf6f0268",
    "feature_width": 12,
    "tokens_per_item": 49,
    "projector_type": "mlp2x_gelu",
    "base_model": "qwen3.5-tiny",
    "base_model_id": "Qwen/Qwen3.5-4B",
    "base_model_revision": "851bf6e806efd8d0a36b00ddf55e13ccb7b8cd0a",
    "hidden_size": 8,
    "sentinel_ids": {"start": 5, "placeholder": 6, "end": 7},
    "stage": "alignment",
}


@pytest.fixture
def projector():
    torch.manual_seed(0)
    return MLP2xGeluProjector(12, 8)


def test_artifact_round_trips_weights_and_records_provenance_and_checksums(tmp_path, projector):
    path = save_projector_artifact(tmp_path / "projector", projector, PROVENANCE)
    assert sorted(p.name for p in path.iterdir()) == [MANIFEST_NAME, WEIGHTS_NAME]
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert {k: manifest[k] for k in PROVENANCE_FIELDS} == PROVENANCE
    assert set(manifest["tensors"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert manifest["tensors"]["0.weight"]["shape"] == [8, 12] and len(manifest["tensors"]["0.weight"]["sha256"]) == 64
    expected = {k: v for k, v in PROVENANCE.items() if k != "stage"}
    state = load_projector_artifact(path, expected)
    fresh = MLP2xGeluProjector(12, 8)
    fresh.load_state_dict(state)
    x = torch.randn(3, 12)
    assert torch.equal(fresh(x), projector(x))


@pytest.mark.parametrize(
    "field,expected",
    [
        ("feature_width", 768),
        ("tokens_per_item", 50),
        ("base_model_revision", "0" * 40),
        ("sentinel_ids", {"start": 5, "placeholder": 60, "end": 7}),
        ("projector_type", "linear"),
        ("encoder_id", "other/encoder"),
    ],
)
def test_loading_refuses_a_provenance_mismatch_naming_field_expected_and_actual(tmp_path, projector, field, expected):
    path = save_projector_artifact(tmp_path / "projector", projector, PROVENANCE)
    with pytest.raises(ArtifactError) as err:
        load_projector_artifact(path, {field: expected})
    message = str(err.value)
    assert f"field {field!r}" in message
    expected_part, actual_part = message.split(" actual ")
    if field == "sentinel_ids":  # a mapping: the manifest stores its keys sorted
        assert "'placeholder': 60" in expected_part and "'placeholder': 6," in actual_part
    else:
        assert repr(expected) in expected_part and repr(PROVENANCE[field]) in actual_part


def test_tampered_tensor_is_refused_naming_the_tensor(tmp_path, projector):
    path = save_projector_artifact(tmp_path / "projector", projector, PROVENANCE)
    state = load_file(str(path / WEIGHTS_NAME))
    state["2.bias"] = state["2.bias"] + 1e-3
    save_file(state, str(path / WEIGHTS_NAME))
    with pytest.raises(ArtifactError, match=r"tensor '2\.bias' checksum mismatch"):
        load_projector_artifact(path)


def test_tensor_set_differing_from_the_manifest_is_refused_naming_the_tensor(tmp_path, projector):
    path = save_projector_artifact(tmp_path / "projector", projector, PROVENANCE)
    state = load_file(str(path / WEIGHTS_NAME))
    del state["0.bias"]
    save_file(state, str(path / WEIGHTS_NAME))
    with pytest.raises(ArtifactError, match=r"tensors \['0\.bias'\] are in only one of"):
        load_projector_artifact(path)


def test_saving_without_every_provenance_field_or_with_a_wrong_width_is_refused(tmp_path, projector):
    partial = {k: v for k, v in PROVENANCE.items() if k != "sentinel_ids"}
    with pytest.raises(ArtifactError, match=r"lacks field\(s\) \['sentinel_ids'\]"):
        save_projector_artifact(tmp_path / "a", projector, partial)
    with pytest.raises(ArtifactError, match=r"field 'feature_width': the projector takes 12, provenance says 768"):
        save_projector_artifact(tmp_path / "b", projector, {**PROVENANCE, "feature_width": 768})
    assert not list(tmp_path.iterdir())


def test_overwrite_is_atomic_and_a_failed_write_keeps_the_previous_artifact(tmp_path, projector, monkeypatch):
    path = save_projector_artifact(tmp_path / "projector", projector, PROVENANCE)
    before = {p.name: p.read_bytes() for p in path.iterdir()}

    import stitch.model.artifacts as artifacts

    def broken_write(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("stitch.model.artifacts.save_file", broken_write)
    with pytest.raises(OSError, match="disk full"):
        artifacts.save_projector_artifact(path, MLP2xGeluProjector(12, 8), {**PROVENANCE, "stage": "sft"})
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["projector"]  # no temp directory left behind
    monkeypatch.undo()

    save_projector_artifact(path, MLP2xGeluProjector(12, 8), {**PROVENANCE, "stage": "sft"})
    assert json.loads((path / MANIFEST_NAME).read_text())["stage"] == "sft"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["projector"]


def test_missing_manifest_or_weights_name_the_file(tmp_path, projector):
    path = save_projector_artifact(tmp_path / "projector", projector, PROVENANCE)
    (path / WEIGHTS_NAME).unlink()
    with pytest.raises(ArtifactError, match=WEIGHTS_NAME.replace(".", r"\.") + " is missing"):
        load_projector_artifact(path)
    (path / MANIFEST_NAME).unlink()
    with pytest.raises(ArtifactError, match="manifest.json is missing"):
        load_projector_artifact(path)


def test_bfloat16_projector_checksums_and_round_trips(tmp_path, projector):
    path = save_projector_artifact(tmp_path / "projector", projector.to(torch.bfloat16), PROVENANCE)
    state = load_projector_artifact(path)
    assert state["0.weight"].dtype == torch.bfloat16
    assert torch.equal(state["0.weight"], projector.state_dict()["0.weight"])
