"""{{ cookiecutter.plugin_name }} as stitch sees it: listed by the CLI, encoding to its declared contract,
refusing corrupt input, a payload that checks feature shapes, and `stitch run` training the shipped
demo recipe end to end. Run with `pytest` after installing."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from stitch.api import load_plugins

from {{ cookiecutter.package_name }}.encoder import (
    ENCODER_NAME,
    FEATURE_WIDTH,
    MODALITY,
    TOKENS_PER_ITEM,
    decode_item,
)

PLUGIN = "{{ cookiecutter.plugin_name }}"
RECIPE = f"{MODALITY}-demo"


def stitch_command() -> list[str]:
    """The `stitch` console script of this interpreter's environment (PATH may point elsewhere)."""
    script = Path(sysconfig.get_path("scripts")) / ("stitch.exe" if os.name == "nt" else "stitch")
    return [str(script)] if script.exists() else [sys.executable, "-m", "stitch"]


@pytest.fixture(scope="module")
def host():
    return load_plugins()


@pytest.fixture(scope="module")
def encoder(host):
    spec = host.get("encoders", ENCODER_NAME)
    return spec.load(spec.source, "cpu", torch.float32)


def signal(n: int, seed: int) -> list[float]:
    return np.random.default_rng(seed).normal(size=n).cumsum().tolist()


def plain_env() -> dict[str, str]:
    """This environment without plugin allow/block lists, so stitch loads every installed plugin."""
    filters = ("STITCH_LOAD_PLUGINS", "STITCH_DISABLED_PLUGINS")
    return {k: v for k, v in os.environ.items() if k not in filters}


def test_stitch_list_plugins_lists_this_plugin_with_its_hooks_and_registrations():
    out = subprocess.run(
        [*stitch_command(), "list-plugins", "--json"],
        capture_output=True, text=True, env=plain_env(), timeout=300,
    )
    assert out.returncode == 0, out.stderr
    listing = json.loads(out.stdout)
    assert [f for f in listing["failed"] if f["name"] == PLUGIN] == []
    mine = [p for p in listing["plugins"] if p["name"] == PLUGIN]
    assert len(mine) == 1, f"{PLUGIN} not listed; listed: {[p['name'] for p in listing['plugins']]}"
    assert mine[0]["hooks"] == ["register_encoders", "register_recipes", "register_rollout_payloads"]
    assert mine[0]["registered"] == {
        "encoders": [ENCODER_NAME], "recipes": [RECIPE], "rollout_payloads": [MODALITY]
    }


def test_packaging_metadata_declares_exactly_what_the_hooks_register(host):
    """stitch reads these entry points (groups ``stitch.KIND``) to name this plugin when one is missing."""
    import importlib.metadata

    entry_points = importlib.metadata.distribution(PLUGIN).entry_points
    declared = {
        (ep.group.removeprefix("stitch."), ep.name) for ep in entry_points if ep.group.startswith("stitch.")
    }
    label = {p["entry_point"] for p in host.describe() if p["name"] == PLUGIN}
    registered = {(reg.kind, reg.name) for reg in host.registrations() if reg.plugin in label}
    assert declared == registered


def test_encoder_spec_declares_the_contract_and_names_its_registered_payload(host):
    spec = host.get("encoders", ENCODER_NAME)
    declared = (spec.modality, spec.tokens_per_item, spec.feature_width)
    assert declared == (MODALITY, TOKENS_PER_ITEM, FEATURE_WIDTH)
    assert host.get("rollout_payloads", spec.payload).modality == MODALITY


def test_encoder_returns_features_of_the_declared_shape_and_dtype(encoder):
    items = [decode_item(signal(300, 0)), decode_item(signal(57, 1)), decode_item(np.arange(5.0))]
    features = encoder.encode(items)
    assert features.shape == (3, TOKENS_PER_ITEM, FEATURE_WIDTH)
    assert features.dtype == torch.float32
    assert torch.isfinite(features).all()


def test_encoder_honours_the_requested_dtype(host):
    spec = host.get("encoders", ENCODER_NAME)
    features = spec.load(spec.source, "cpu", torch.bfloat16).encode([decode_item(signal(64, 0))])
    assert features.dtype == torch.bfloat16
    assert features.shape == (1, TOKENS_PER_ITEM, FEATURE_WIDTH)


def test_encoder_is_frozen_and_deterministic(host, encoder):
    items = [decode_item(signal(128, 3))]
    spec = host.get("encoders", ENCODER_NAME)
    reloaded = spec.load(spec.source, "cpu", torch.float32)
    assert torch.equal(encoder.encode(items), reloaded.encode(items))
    assert not any(p.requires_grad for p in encoder.module.parameters())


def test_features_follow_the_signal(encoder):
    a, b = encoder.encode([decode_item(signal(200, 4)), decode_item(signal(200, 5))])
    assert not torch.allclose(a, b, atol=1e-3)


def test_decode_item_reads_lists_arrays_npy_files_bytes_and_text(tmp_path):
    values = signal(40, 6)
    npy = tmp_path / "item.npy"
    np.save(npy, np.asarray(values))
    txt = tmp_path / "item.csv"
    txt.write_text(",".join(repr(v) for v in values))
    expected = decode_item(values)
    assert expected.dtype == torch.float32 and expected.shape == (40,)
    for value in (np.asarray(values), torch.tensor(values), str(npy), npy, npy.read_bytes(),
                  {"bytes": npy.read_bytes(), "path": None}, {"bytes": None, "path": str(npy)}, str(txt)):
        assert torch.equal(decode_item(value), expected), type(value)


def npy_bytes(array) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(array))
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (b"\x00\x01 not an npy file", "18 bytes is not a .npy array (no .npy header)"),
        (npy_bytes(np.arange(100.0))[:-40], "not a readable .npy array"),
        ("/nonexistent/item.npy", "no such file"),
        ([1.0, float("nan"), 3.0], "non-finite value(s), the first at index 1"),
        ([], "at least"),
        ([[1.0, 2.0], [3.0, 4.0]], "1-D signal"),
        ([[1.0, 2.0], [3.0]], "not numbers"),
        (["a", "b"], "not numbers"),
        (npy_bytes(np.array(["a", "b"])), "not real numbers"),
        ({"neither": 1}, "needs 'bytes' or 'path'"),
        (object(), "got object"),
    ],
    ids=["garbage-bytes", "truncated-npy", "missing-file", "nan", "empty", "2-d", "ragged", "strings",
         "npy-of-strings", "bad-dict", "wrong-type"],
)
def test_decode_item_refuses_corrupt_input_with_a_clear_error(value, says):
    with pytest.raises(ValueError, match="cannot decode") as err:
        decode_item(value)
    assert says in str(err.value)


def test_decode_item_refuses_corrupt_files_naming_them(tmp_path):
    garbage = tmp_path / "garbage.npy"
    garbage.write_bytes(b"\x80\x04 pickled, not an array")
    words = tmp_path / "words.txt"
    words.write_text("1.0 2.0 three")
    truncated = tmp_path / "truncated.npy"
    truncated.write_bytes(npy_bytes(np.arange(100.0))[:-40])
    for path, says in ((garbage, "no .npy header"), (words, "is not numbers"), (truncated, "not a readable")):
        with pytest.raises(ValueError, match="cannot decode") as err:
            decode_item(path)
        assert str(path) in str(err.value) and says in str(err.value)


def test_payload_builds_soft_tokens_from_features_of_the_declared_shape(host, encoder):
    payload_spec = host.get("rollout_payloads", MODALITY)
    assert payload_spec.fields == (MODALITY,)
    features = encoder.encode([decode_item(signal(80, 7)), decode_item(signal(90, 8))])
    projector = torch.nn.Linear(FEATURE_WIDTH, 24)
    payload = payload_spec.build("row-7", features, projector)
    payload_spec.validate(payload)
    assert payload["soft_tokens"].shape == (2 * TOKENS_PER_ITEM, 24)


@pytest.mark.parametrize(
    ("features", "says"),
    [
        (torch.zeros(1, TOKENS_PER_ITEM + 1, FEATURE_WIDTH), "expected [items"),
        (torch.zeros(1, TOKENS_PER_ITEM, FEATURE_WIDTH + 1), "expected [items"),
        (torch.zeros(TOKENS_PER_ITEM, FEATURE_WIDTH), "expected [items"),
        (torch.full((1, TOKENS_PER_ITEM, FEATURE_WIDTH), float("inf")), "non-finite"),
        (np.zeros((1, TOKENS_PER_ITEM, FEATURE_WIDTH)), "must be a tensor"),
    ],
    ids=["tokens", "width", "no-item-axis", "inf", "not-a-tensor"],
)
def test_payload_refuses_features_of_another_shape_naming_the_row(host, features, says):
    payload_spec = host.get("rollout_payloads", MODALITY)
    with pytest.raises(ValueError, match="row-9") as err:
        payload_spec.validate({"row_id": "row-9", MODALITY: features})
    assert says in str(err.value)
    with pytest.raises(ValueError, match="no field"):
        payload_spec.validate({"row_id": "row-9"})


# -- the shipped demo recipe ----------------------------------------------------------------------------


def test_demo_recipe_is_registered_with_its_bundled_data(host):
    path = Path(host.get("recipes", RECIPE).path)
    recipe = yaml.safe_load(path.read_text())
    assert recipe["encoder"] == ENCODER_NAME and recipe["data"]["columns"]["media"] == MODALITY
    data = path.parent / recipe["data"]["source"]["path"]
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(rows) == recipe["data"]["scan_cap"]
    for row in rows:
        item = decode_item(data.parent / row[MODALITY])
        assert item.ndim == 1 and row["answer"].startswith("The answer is ")


def test_stitch_run_trains_the_demo_recipe_end_to_end(tmp_path):
    """`stitch run` on the recipe this plugin ships: prepare (this encoder, once per row), alignment,
    SFT, GRPO, evaluation and one inference, with stitch-qwen's tiny Qwen3.5 as the base model."""
    out = tmp_path / "run"
    result = subprocess.run(
        [*stitch_command(), "run", RECIPE, "--out", str(out)],
        capture_output=True, text=True, env=plain_env(), timeout=1200,
    )
    tail = f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert result.returncode == 0, f"stitch run failed:\n{tail}"
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["recipe"], summary["encoder"]) == (RECIPE, ENCODER_NAME)
    assert {"prepare", "alignment", "sft", "grpo"} <= set(summary["stages"])
    for stage in ("alignment", "sft", "grpo"):
        assert (out / stage / "checkpoints" / "LATEST").is_file(), stage
    assert isinstance(summary["inference"]["answer"], str)

    # the trained model answers about a new item of this modality: `stitch infer --media FILE`
    item = tmp_path / "item.npy"
    np.save(item, np.asarray(signal(120, 11), dtype=np.float32))
    infer = subprocess.run(
        [*stitch_command(), "infer", "--adapter", str(out / "grpo" / "checkpoints"), "--media", str(item),
         "--question", "How many cycles does this signal go through?"],
        capture_output=True, text=True, env=plain_env(), timeout=600,
    )
    assert infer.returncode == 0, infer.stderr[-3000:]
    # an answer: any text after a few steps
    assert "checkpoint:" in infer.stderr and infer.stdout.endswith("\n")

