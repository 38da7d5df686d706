"""The demo base and the tiny presets are the same bytes on every build, and the demo base can count in text.

Every figure the README quotes for the demo holds for one base; a build that drifts with the machine's thread
count or kernel choice would make them hold for none.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from stitch.host.host import get_host
from stitch.plugins.snapshot_cache import ensure_snapshot


def digests(snapshot: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(snapshot.iterdir()) if p.suffix in {".safetensors", ".json"}}


def build_fresh(spec, tmp_path: Path, label: str) -> Path:
    out = tmp_path / label
    out.mkdir()
    spec.source.builder(out)
    return out


def test_demo_base_pretraining_writes_identical_weights_again_under_another_thread_count(tmp_path):
    """The demo base is ``write_qwen35_demo_init`` (seeded ``write_snapshot``, which
    ``test_tiny_preset_builds_to_identical_bytes_twice`` holds to its bytes) followed by ``pretrain_in_place``. This
    holds the second to the same bytes under two caller thread counts, on a short run of the builder's own code: a
    second full 300-step build cost ~100 s of CI on 2 cores."""
    from stitch.demo.pretrain import pretrain_in_place
    from stitch_qwen.sentinels import SENTINELS
    from stitch_qwen.tiny import write_qwen35_demo_init

    init = tmp_path / "init"
    init.mkdir()
    write_qwen35_demo_init(init)
    threads = torch.get_num_threads()
    built = {}
    try:
        for count in (1, 2):
            shutil.copytree(init, tmp_path / f"threads{count}")
            torch.set_num_threads(count)
            pretrain_in_place(tmp_path / f"threads{count}", SENTINELS.tokens, steps=6, batch_size=32)
            built[count] = digests(tmp_path / f"threads{count}")
    finally:
        torch.set_num_threads(threads)
    assert built[1]["model.safetensors"] != digests(init)["model.safetensors"]  # the weights did train
    assert built[1] == built[2]


@pytest.mark.parametrize("kind,name", [("encoders", "clip-demo"), ("encoders", "clip-tiny"),
                                       ("models", "qwen3.5-tiny"), ("models", "nemotron-nano-tiny")])
def test_tiny_preset_builds_to_identical_bytes_twice(host, tmp_path, kind, name):
    spec = host.get(kind, name)
    assert digests(build_fresh(spec, tmp_path, "a")) == digests(build_fresh(spec, tmp_path, "b"))


def test_demo_base_counts_the_colour_words_of_a_text_media_block(host):
    """The pre-training's point: the base reads a count off its media block (here spelled as words)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stitch.demo.pretrain import task_examples
    from stitch.demo.tiny import COUNT_QUESTION

    spec = host.get("models", "qwen3.5-demo")
    snapshot = ensure_snapshot(spec.source.builder_key, spec.source.builder)
    tokenizer = AutoTokenizer.from_pretrained(snapshot)
    model = AutoModelForCausalLM.from_pretrained(snapshot, use_safetensors=True).eval()
    sentinels = host.get("token_sentinels", spec.sentinels).tokens
    right = total = 0
    end = tokenizer.convert_tokens_to_ids(sentinels[2])
    for ids, _ in task_examples(tokenizer, sentinels, 49, 200, seed=12345):  # not the pre-training's seed
        if COUNT_QUESTION not in tokenizer.decode(ids):
            continue
        # the count: the first digit after the media block
        digit = next(i for i in range(ids.index(end), len(ids)) if tokenizer.decode([ids[i]]).strip().isdigit())
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids[:digit]])).logits[0, -1]
        right += int(logits.argmax() == ids[digit])
        total += 1
    assert total >= 100
    assert right / total >= 0.9, (right, total)


def test_counting_rows_hold_every_count_once_in_every_block_of_eight():
    from collections import Counter

    from stitch.demo.data import make_rows
    from stitch.demo.tiny import MAX_OBJECTS

    rows = make_rows(8 * 20, seed=4)
    for start in range(0, len(rows), 8):
        assert sorted(r["count"] for r in rows[start : start + 8]) == list(range(1, MAX_OBJECTS + 1))
    assert Counter(r["answer"] for r in rows).most_common(1)[0][1] == 20  # no answer beats 1/8


def test_each_object_sits_inside_its_own_patch_cell():
    import random

    from stitch.demo.data import CELL, CELL_RADIUS, sample_scene

    for i in range(200):
        objects = sample_scene(random.Random(i), 8)
        cells = [(o.y // CELL, o.x // CELL) for o in objects]
        assert len(set(cells)) == len(objects) and cells == sorted(cells)  # one per cell, reading order
        for o in objects:
            r = CELL_RADIUS[o.size]
            assert (o.x - r) // CELL == (o.x + r) // CELL == o.x // CELL
            assert (o.y - r) // CELL == (o.y + r) // CELL == o.y // CELL


def test_annotator_undercounts_only_eight_object_scenes_inside_its_rows():
    from stitch.demo.data import make_rows

    rows = make_rows(8 * 50, caption_rows=16, seed=0, annotator_rows=(16, 8 * 40), undercount=0.7)
    stated = [int(r["answer"].split()[-1].rstrip(".")) if r["task"] == "count" else None for r in rows]
    wrong = [i for i, r in enumerate(rows) if r["task"] == "count" and stated[i] != r["count"]]
    assert wrong and all(16 <= i < 320 and rows[i]["count"] == 8 and stated[i] == 7 for i in wrong)
    eights = [i for i in range(16, 320) if rows[i]["count"] == 8]
    assert 0.55 <= len(wrong) / len(eights) <= 0.85  # 38 scenes at p = 0.7
    assert make_rows(8 * 50, caption_rows=16, seed=0)[320:] == rows[320:]  # outside its rows: the truth


def test_annotator_options_are_refused_for_a_builtin_without_an_annotator(tmp_path):
    from stitch.config.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match="annotator_rows"):
        load_recipe("demo-colors", get_host(), overrides=["data.source.annotator_rows=[0, 10]"])
    with pytest.raises(RecipeError, match="annotator_rows"):
        load_recipe("demo", get_host(), overrides=["data.source.annotator_rows=[10, 5]"])


@pytest.mark.parametrize("name", ["clip-demo", "clip-tiny"])
def test_clip_encoder_equals_the_full_towers_penultimate_layer_through_the_snapshots_processor(host, name):
    """The encoder skips the unused last layer and vectorises CLIP's preprocessing; neither may move a feature."""
    import random

    from PIL import Image
    from transformers import CLIPVisionModel

    from stitch.demo.data import render_scene, sample_scene

    spec = host.get("encoders", name)
    encoder = spec.load(spec.source, "cpu", torch.float32)
    full = CLIPVisionModel.from_pretrained(ensure_snapshot(spec.source.builder_key, spec.source.builder),
                                           use_safetensors=True).eval()
    scenes = [render_scene(sample_scene(random.Random(i))) for i in range(4)]
    for images in (scenes, [Image.new("RGB", (300, 200), (10, 200, 30))]):  # the fast path, then the processor's
        pixels = encoder.processor(images=images, return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            want = full(pixel_values=pixels, output_hidden_states=True).hidden_states[-2][:, 1:]
        got = encoder.encode(images)
        assert got.shape == (len(images), 49, spec.feature_width)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    assert len(tower_layers(encoder.model)) == len(tower_layers(full)) - 1  # the last layer is never run


def tower_layers(model):
    return getattr(model, "vision_model", model).encoder.layers


def test_reading_the_demo_bases_tokenizer_builds_no_weights_and_matches_the_full_snapshots(host, tmp_path,
                                                                                         monkeypatch):
    """Prepare's row checks read the tokenizer; for the demo base that must not mean pre-training an LM."""
    from stitch.model.loading import load_tokenizer
    from stitch.plugins.snapshot_cache import snapshot_dir, snapshot_ready

    spec = host.get("models", "qwen3.5-demo")
    full = ensure_snapshot(spec.source.builder_key, spec.source.builder)  # the session cache's build
    monkeypatch.setenv("STITCH_CACHE", str(tmp_path / "empty-cache"))
    tokenizer = load_tokenizer(spec)
    assert not snapshot_ready(spec.source.builder_key)  # the weights were not built
    only = snapshot_dir(f"{spec.source.builder_key}-tokenizer")
    assert not list(only.glob("*.safetensors"))
    shared = {n for n in digests(only) if n.startswith("tokenizer") or n == "special_tokens_map.json"}
    assert "tokenizer.json" in shared
    assert {n: digests(only)[n] for n in shared} == {n: digests(full)[n] for n in shared}
    assert tokenizer.convert_tokens_to_ids("<|vision_start|>") != tokenizer.unk_token_id


def test_a_preset_built_under_another_transformers_version_is_built_again_not_reused(tmp_path, monkeypatch):
    # the quickstart installs the newest transformers in range, the test install pins one: a build records its
    # version in config.json, so sharing one cache entry made the byte-identity test fail after the quickstart
    import transformers

    from stitch.plugins.snapshot_cache import snapshot_dir

    monkeypatch.setenv("STITCH_CACHE", str(tmp_path))
    builds = []

    def builder(out: Path) -> None:
        builds.append(transformers.__version__)
        (out / "config.json").write_text(f'{{"transformers_version": "{transformers.__version__}"}}')

    first = ensure_snapshot("preset", builder)
    assert ensure_snapshot("preset", builder) == first and builds == [transformers.__version__]
    monkeypatch.setattr(transformers, "__version__", "0.0.1")
    second = ensure_snapshot("preset", builder)
    assert second != first and second == snapshot_dir("preset") and builds[-1] == "0.0.1"
    assert first.is_dir()  # the other version's build stays for that version
