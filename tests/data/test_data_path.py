"""Recipes, the demo dataset, the feature-cache reader and projectors: contracts and their error messages."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import yaml

from stitch.config.recipe import HubSource, LocalSource, RecipeError, load_recipe, parse_recipe
from stitch.data.feature_cache import (
    CACHE_DIRNAME,
    MANIFEST_NAME,
    SHARD_FORMAT,
    FeatureCacheError,
    FeatureKey,
    ManifestRow,
    PreparedData,
    UnknownRowError,
)
from stitch.demo.tiny import CAPTION_QUESTION, COLORS, COUNT_QUESTION, MAX_OBJECTS, SHAPES, SIZES, answer_text
from stitch.model.projector import FeatureWidthError, check_feature_width
from stitch.runs.digest import file_sha256

BASE = {
    "name": "t",
    "model": "qwen3.5-tiny",
    "encoder": "clip-tiny",
    "data": {
        "source": {"builtin": "counting-shapes", "rows": 100},
        "columns": {"media": "image", "question": "question", "answer": "answer"},
        "partitions": {"sft": [0, 80], "grpo": [80, 100]},
        "scan_cap": 128,
        "budgets": {"transient_mib": 512, "retained_mib": 64},
    },
    "stages": {"sft": {"steps": 3, "partition": "sft", "eval_partition": None}},
}


def with_field(path: str, value):
    recipe = copy.deepcopy(BASE)
    *parents, last = path.split(".")
    node = recipe
    for key in parents:
        node = node[key]
    if value is _DROP:
        del node[last]
    else:
        node[last] = value
    return recipe


_DROP = object()


# -- recipes ---------------------------------------------------------------------------------------------


def test_recipe_parses_into_frozen_dataclasses_with_defaults():
    recipe = parse_recipe(BASE)
    assert recipe.projector == "mlp2x_gelu" and recipe.data.on_corrupt == "error"
    assert [(p.name, p.start, p.end) for p in recipe.data.partitions] == [("sft", 0, 80), ("grpo", 80, 100)]
    assert recipe.data.rows_needed == 100 and recipe.stage("sft") == BASE["stages"]["sft"]
    with pytest.raises(AttributeError):
        recipe.name = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    "path,value,field,fragment",
    [
        ("data.partitions.grpo", [90, 80], "data.partitions.grpo", "[90, 80]"),
        ("data.partitions.grpo", [70, 100], "data.partitions", "overlap"),
        ("data.scan_cap", 50, "data.scan_cap", "at least 100"),
        ("data.on_corrupt", "ignore", "data.on_corrupt", "one of error, skip"),
        ("data.budgets.retained_mib", -1, "data.budgets.retained_mib", "-1"),
        ("data.feature_dtype", "float8", "data.feature_dtype", "float16"),
        ("data.source.rows", "many", "data.source.rows", "'many'"),
        ("data.source.rows", 90, "data.source.rows", "at least 100"),
        ("data.columns.answer", _DROP, "data.columns.answer", "missing"),
        ("data.columns.colour", "c", "data.columns.colour", "unknown field"),
        ("model", _DROP, "model", "missing"),
        ("data.scan_cap", True, "data.scan_cap", "True"),
    ],
)
def test_invalid_recipe_field_is_refused_naming_the_field_expected_and_actual(path, value, field, fragment):
    with pytest.raises(RecipeError) as err:
        parse_recipe(with_field(path, value), path=Path("/r/bad.yaml"))
    message = str(err.value)
    assert f"'{field}'" in message and fragment in message and "/r/bad.yaml" in message


def test_hub_source_requires_a_pinned_40_hex_revision():
    hub = {"hub": "lmms-lab/LLaVA-OneVision-Data", "config": "CLEVR-Math(MathV360K)", "revision": "main"}
    with pytest.raises(RecipeError, match=r"'data.source.revision': expected a pinned 40-hex commit sha.*'main'"):
        parse_recipe(with_field("data.source", hub))
    hub["revision"] = "7ca5e5bf8b2006d5dfa0549756198474f0897f63"
    source = parse_recipe(with_field("data.source", hub)).data.source
    assert isinstance(source, HubSource) and source.split == "train" and source.config == "CLEVR-Math(MathV360K)"
    with pytest.raises(RecipeError, match=r"'data.source.revision' is missing"):
        parse_recipe(with_field("data.source", {"hub": "org/name"}))


def test_local_source_path_is_resolved_against_the_recipe_directory(tmp_path):
    recipe = with_field("data.source", {"path": "data/train.parquet", "format": "parquet"})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    source = load_recipe(tmp_path / "r.yaml").data.source
    assert isinstance(source, LocalSource) and source.path == tmp_path / "data" / "train.parquet"
    with pytest.raises(RecipeError, match=r"'data.source.format': expected one of parquet, arrow, json, imagefolder"):
        parse_recipe(with_field("data.source", {"path": "x", "format": "csv"}))


def test_messages_column_mapping_excludes_question_and_answer():
    recipe = with_field("data.columns", {"media": "image", "messages": "conversations"})
    assert parse_recipe(recipe).data.columns.text_columns == ("conversations",)
    both = with_field("data.columns", {"media": "image", "messages": "m", "question": "q", "answer": "a"})
    with pytest.raises(RecipeError, match=r"'data.columns.messages'"):
        parse_recipe(both)


def test_recipe_by_name_comes_from_the_registry_and_by_path_from_the_file(host, tmp_path):
    demo = load_recipe("demo", host)
    assert demo.path == Path(host.get("recipes", "demo").path) and len(demo.digest) == 64
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(BASE))
    assert load_recipe(str(tmp_path / "mine.yaml")).name == "t"
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "missing.yaml")


def test_shipped_demo_recipe_names_registered_specs_and_its_stages_use_its_partitions(host):
    demo = load_recipe("demo", host)
    host.get("projectors", demo.projector)
    partitions = {p.name for p in demo.data.partitions}
    for stage, options in demo.stages.items():
        for key in ("partition", "eval_partition"):
            if getattr(options, key) is not None:
                assert getattr(options, key) in partitions, (stage, key)
    # the demo's features fit its retained budget: tokens x width fp16 per row
    encoder = host.get("encoders", demo.encoder)
    row_bytes = encoder.tokens_per_item * encoder.feature_width * 2
    assert sum(p.rows for p in demo.data.partitions) * row_bytes < demo.data.budgets.retained_bytes


# -- demo dataset ----------------------------------------------------------------------------------------


def test_demo_rows_are_deterministic_use_the_tiny_vocabulary_and_state_the_count():
    from stitch.demo.data import make_rows

    rows = make_rows(30, caption_rows=10, seed=0)
    assert rows == make_rows(30, caption_rows=10, seed=0)
    assert make_rows(12, caption_rows=10, seed=0) == rows[:12]  # a longer dataset extends a shorter one
    assert rows != make_rows(30, caption_rows=10, seed=1)
    vocabulary = set(COLORS) | set(SHAPES) | set(SIZES)
    for row in rows[:10]:
        assert row["question"] == CAPTION_QUESTION and row["task"] == "caption"
        n = row["count"]
        assert row["answer"].startswith("There is 1 object" if n == 1 else f"There are {n} objects")
        words = {w.strip(",.:") for w in row["answer"].split()}
        assert {w for w in words if w in vocabulary}, row["answer"]
    for row in rows[10:]:
        assert row["question"] == COUNT_QUESTION and row["answer"] == answer_text(row["count"])
        assert 1 <= row["count"] <= MAX_OBJECTS


def test_demo_image_is_a_224px_png_with_one_blob_per_counted_object():
    import io

    from PIL import Image

    from stitch.demo.data import BACKGROUND, make_rows

    for row in make_rows(6, seed=2):
        image = Image.open(io.BytesIO(row["image"]["bytes"]))
        assert image.format == "PNG" and image.size == (224, 224)
        # count 4-connected non-background blobs on a downsampled grid
        pixels = image.convert("RGB").load()
        seen, blobs = set(), 0
        for y in range(224):
            for x in range(224):
                if pixels[x, y] != BACKGROUND and (x, y) not in seen:
                    blobs += 1
                    stack = [(x, y)]
                    while stack:
                        px, py = stack.pop()
                        if (px, py) in seen or not (0 <= px < 224 and 0 <= py < 224):
                            continue
                        if pixels[px, py] == BACKGROUND:
                            continue
                        seen.add((px, py))
                        stack += [(px + 1, py), (px - 1, py), (px, py + 1), (px, py - 1)]
        assert blobs == row["count"], row["id"]


def test_demo_dataset_streams_back_through_datasets_with_an_image_column(tmp_path):
    from datasets import Image, load_dataset

    from stitch.demo.data import write_counting_shapes

    parquet = write_counting_shapes(tmp_path, rows=5, caption_rows=2, seed=0)
    stream = load_dataset("parquet", data_files=str(parquet), split="train", streaming=True,
                          cache_dir=str(tmp_path / "cache"))
    assert isinstance(stream.features["image"], Image)
    rows = list(stream)
    assert [r["id"] for r in rows] == [f"shapes-0-{i:06d}" for i in range(5)]
    assert rows[0]["image"].size == (224, 224)


# -- prepared data reader --------------------------------------------------------------------------------


def _prepared_dir(tmp_path: Path, shard: str = "abc.safetensors", index: int = 1) -> Path:
    from stitch.data.prepare import write_shard

    root = tmp_path / "prepared"
    (root / CACHE_DIRNAME).mkdir(parents=True)
    write_shard(root / CACHE_DIRNAME / "abc.safetensors", torch.arange(2 * 3 * 4.0).reshape(2, 3, 4), {})
    row = ManifestRow(
        id="r1", partition="sft", messages=({"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}),
        features=(FeatureKey("abc.safetensors", 1),), tokens=3, width=4, dtype="float32", provenance={},
    ).as_json()
    row["features"] = [{"shard": shard, "index": index}]
    (root / MANIFEST_NAME).write_text(json.dumps(row) + "\n")
    return root


def test_prepared_data_loads_a_rows_features_by_shard_and_index(tmp_path):
    data = PreparedData(_prepared_dir(tmp_path))
    row = data.row("r1")
    assert row.question == "q" and row.answer == "a"
    assert torch.equal(data.features(row), torch.arange(12, 24.0).reshape(1, 3, 4))


def test_unknown_row_id_is_refused_naming_the_id_and_the_manifest(tmp_path):
    data = PreparedData(_prepared_dir(tmp_path))
    with pytest.raises(UnknownRowError) as err:
        data.row("r404")
    assert "'r404'" in str(err.value) and MANIFEST_NAME in str(err.value) and "r1" in str(err.value)


@pytest.mark.parametrize("shard", ["../x.safetensors", "/etc/x.safetensors", "sub/x.safetensors", ".."])
def test_manifest_feature_key_escaping_the_cache_root_is_refused(tmp_path, shard):
    data = PreparedData(_prepared_dir(tmp_path, shard=shard))
    with pytest.raises(FeatureCacheError) as err:
        list(data.rows())
    assert "'r1'" in str(err.value) and repr(shard) in str(err.value) and "escape" in str(err.value)


def test_symlinked_shard_pointing_outside_the_cache_is_refused(tmp_path):
    root = _prepared_dir(tmp_path, shard="link.safetensors")
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((root / CACHE_DIRNAME / "abc.safetensors").read_bytes())
    (root / CACHE_DIRNAME / "link.safetensors").symlink_to(outside)
    with pytest.raises(FeatureCacheError, match="resolves outside"):
        PreparedData(root).features("r1")


def test_feature_index_out_of_range_names_row_shard_and_size(tmp_path):
    data = PreparedData(_prepared_dir(tmp_path, index=7))
    with pytest.raises(FeatureCacheError, match=r"row 'r1': index 7 is out of range for shard abc.safetensors \(2 items\)"):
        data.features("r1")


def test_missing_manifest_says_to_run_prepare(tmp_path):
    with pytest.raises(FeatureCacheError, match="stitch prepare"):
        PreparedData(tmp_path)


# -- projectors ------------------------------------------------------------------------------------------


def test_registered_projectors_map_feature_width_to_hidden_width(host):
    x = torch.randn(2, 49, 32)
    mlp = host.get("projectors", "mlp2x_gelu").build(32, 16)
    assert [type(m).__name__ for m in mlp] == ["Linear", "GELU", "Linear"]
    assert (mlp[0].in_features, mlp[0].out_features, mlp[2].in_features, mlp[2].out_features) == (32, 16, 16, 16)
    assert mlp(x).shape == (2, 49, 16)
    linear = host.get("projectors", "linear").build(32, 16)
    assert set(linear.state_dict()) == {"weight", "bias"} and linear(x).shape == (2, 49, 16)


def test_feature_width_not_matching_the_projector_input_is_refused_naming_rows_expected_and_actual(host):
    projector = host.get("projectors", "mlp2x_gelu").build(768, 16)
    with pytest.raises(FeatureWidthError) as err:
        check_feature_width(projector, torch.zeros(1, 49, 512), ["row-7"])
    assert "row-7" in str(err.value) and "512" in str(err.value) and "768" in str(err.value)
    check_feature_width(projector, torch.zeros(1, 49, 768), ["row-7"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64])
def test_a_shard_file_is_byte_for_byte_what_safetensors_writes_and_its_digest_is_the_files_sha256(tmp_path, dtype):
    """stitch writes a shard's bytes itself and hashes them from memory (round 20): the file must still be the one
    safetensors' own writer makes (readers and older caches rely on it), and the digest the file's own sha256.
    int64 is not a shard dtype: it goes through safetensors' writer and a re-read."""
    from safetensors.torch import load_file, save_file

    from stitch.data.feature_cache import write_tensor_file

    features = (torch.randn(5, 3, 7) * 100).to(dtype)
    # metadata as a shard's: JSON text, here with quotes, a backslash, a newline, a tab and non-ASCII text
    meta = {SHARD_FORMAT: json.dumps({"model": 'a "b" \\ c\n\td', "name": "émoji ☃"}, sort_keys=True,
                                     ensure_ascii=False)}
    digest = write_tensor_file(tmp_path / "ours.safetensors", "features", features, meta)
    save_file({"features": features}, str(tmp_path / "theirs.safetensors"), metadata=meta)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()
    assert digest == file_sha256(tmp_path / "ours.safetensors")
    assert torch.equal(load_file(str(tmp_path / "ours.safetensors"))["features"], features)


def test_a_shard_written_from_a_non_contiguous_tensor_holds_its_values_in_order(tmp_path):
    from safetensors.torch import load_file

    from stitch.data.feature_cache import write_tensor_file

    features = torch.randn(4, 6, 3).to(torch.bfloat16).transpose(0, 1)  # [6, 4, 3], not contiguous
    digest = write_tensor_file(tmp_path / "t.safetensors", "features", features, {"k": "v"})
    assert torch.equal(load_file(str(tmp_path / "t.safetensors"))["features"], features)
    assert digest == file_sha256(tmp_path / "t.safetensors")


def test_a_shard_digest_covers_every_byte_even_when_the_hashing_thread_is_slower_than_the_write(tmp_path, monkeypatch):
    """The tensor's bytes are hashed on a second thread while they are written: the digest returned must wait for
    that thread, however long it takes."""
    import hashlib
    import threading
    import time

    import stitch.data.feature_cache as feature_cache

    real_sha256 = hashlib.sha256

    class SlowSha256:
        def __init__(self, data: bytes = b"") -> None:
            self.inner = real_sha256(data)

        def update(self, data) -> None:
            if threading.current_thread() is not threading.main_thread():
                time.sleep(0.3)  # the write finishes long before this
            self.inner.update(data)

        def hexdigest(self) -> str:
            return self.inner.hexdigest()

    monkeypatch.setattr(feature_cache.hashlib, "sha256", SlowSha256)
    features = torch.randn(4, 5, 6).to(torch.bfloat16)
    digest = feature_cache.write_tensor_file(tmp_path / "s.safetensors", "features", features, {"k": "v"})
    monkeypatch.undo()
    assert digest == file_sha256(tmp_path / "s.safetensors")
