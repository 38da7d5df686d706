"""The formats users bring, each read from a fixture written in that format exactly (tests/data/fixtures/formats):
LLaVA JSON, OpenAI/ShareGPT messages with content parts, parquet with image bytes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml

from stitch.config.recipe import load_recipe
from stitch.data.collator import IMAGE_MARKER
from stitch.data.feature_cache import PreparedData
from tests.stitch_testing import prepare_resolved

pytest.importorskip("stitch_clip", reason="the tiny CLIP encoder comes from the stitch-clip plugin")

FIXTURES = Path(__file__).parent / "fixtures" / "formats"


@pytest.fixture(scope="module")
def host_module():
    from stitch.host.host import load_plugins

    return load_plugins()


@pytest.fixture(scope="module")
def clip(host_module):
    spec = host_module.get("encoders", "clip-tiny")
    return spec.load(spec.source, "cpu", torch.float16)


def _prepare(tmp_path: Path, host, clip, source: dict, columns: dict, rows: int, **data) -> tuple:
    shutil.copytree(FIXTURES, tmp_path / "data")
    recipe = {"name": "formats", "model": "qwen3.5-tiny", "encoder": "clip-tiny", "data": {
        "source": {**source, "path": f"data/{source['path']}"}, "columns": columns, "partitions": {"train": [0, rows]},
        "scan_cap": 8, "budgets": {"transient_mib": 64, "retained_mib": 16}, "feature_dtype": "float16",
        "prepare": {"workers": 0}, **data}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    report = prepare_resolved(load_recipe(path), tmp_path / "out", host=host, encoder=clip, progress=False)
    return report, list(PreparedData(tmp_path / "out").rows())


def test_llava_json_conversations_keep_every_turn_and_the_image_marker_where_it_stands(tmp_path, host_module, clip):
    _, rows = _prepare(tmp_path, host_module, clip, {"path": "llava.json", "format": "json"},
                       {"id": "id", "media": "image", "messages": "conversations"}, 3)
    assert [r.id for r in rows] == ["llava-0", "llava-1", "llava-2"]
    two_turns = rows[1]
    assert [m["role"] for m in two_turns.messages] == ["user", "assistant", "user", "assistant"]
    assert two_turns.messages[0]["content"] == f"What color are the circles?\n{IMAGE_MARKER}"
    assert two_turns.prompt_messages[-1] == {"role": "user", "content": "How many are there?"}
    assert two_turns.num_items == 1


def test_openai_content_parts_become_markers_and_a_marker_miscount_is_skipped_by_name(tmp_path, host_module, clip):
    report, rows = _prepare(tmp_path, host_module, clip, {"path": "openai.jsonl", "format": "json"},
                            {"id": "id", "media": "images", "messages": "messages"}, 2, on_corrupt="skip")
    assert [r.id for r in rows] == ["oai-0", "oai-1"]  # oai-2 stands between them in the file
    assert rows[0].messages[0] == {"role": "system", "content": "Answer briefly."}
    assert rows[0].messages[1]["content"] == (f"Here is one picture: {IMAGE_MARKER} and another: {IMAGE_MARKER}. "
                                              f"Which has more circles?")
    assert rows[0].num_items == 2
    assert report.skipped_by_reason == {"image-count": {"count": 1, "row_ids": ["oai-2"]}}
    assert "1 <image> marker(s) in the text but 2 media item(s)" in report.skipped[0]["reason"]


def test_parquet_with_image_bytes_is_read_without_touching_any_path(tmp_path, host_module, clip):
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(FIXTURES / "images.parquet", tmp_path / "elsewhere" / "images.parquet")  # no images/ beside it
    _, rows = _prepare(tmp_path, host_module, clip, {"path": "images.parquet", "format": "parquet"},
                       {"id": "id", "media": "image", "question": "question", "answer": "answer"}, 3)
    assert [r.id for r in rows] == ["pq-0", "pq-1", "pq-2"]
    assert rows[0].messages[0]["content"] == f"{IMAGE_MARKER}\nHow many circles?"
    data = PreparedData(tmp_path / "out")
    features = [data.features(r) for r in rows]
    assert all(f.shape == (1, 49, 768) for f in features)
    assert not torch.equal(features[0], features[1])  # different images, different features


def test_arrow_with_image_bytes_reads_as_parquet_does(tmp_path, host_module, clip):
    """``format: arrow``: an Arrow IPC stream file (what ``datasets`` writes) holding the parquet fixture's table."""
    _, rows = _prepare(tmp_path, host_module, clip, {"path": "images.arrow", "format": "arrow"},
                       {"id": "id", "media": "image", "question": "question", "answer": "answer"}, 3)
    assert [r.id for r in rows] == ["pq-0", "pq-1", "pq-2"]
    features = [PreparedData(tmp_path / "out").features(r) for r in rows]
    assert all(f.shape == (1, 49, 768) for f in features) and not torch.equal(features[0], features[1])
