"""The video route of the CLIP plugin: frames sampled at a count or a rate from real MP4 files, each frame encoded
once, temporal pooling giving the declared token count, clips bracketed by their own sentinels behind a
``<video>`` marker, bad clips named by kind before any encoding, and `stitch serve` taking a ``video_url`` part
rendered as training renders the row."""

from __future__ import annotations

import base64
import random
import sys

import numpy as np
import pytest
import torch

from stitch.config.recipe import load_recipe
from stitch.data.collator import prompt_token_ids, tokenize_example
from stitch.plugins.specs import SentinelLayoutError, SentinelSpec
from stitch.rollout.prompts import MEDIA, conversation_prompt_ids
from stitch.serve.chat import Limits, RequestError, parse_chat_request
from tests.stitch_testing import prepare_inputs, write_recipe

av = pytest.importorskip("av", reason="the video route decodes clips with PyAV (stitch-clip[video])")
pytest.importorskip("stitch_clip", reason="the video encoders come from the stitch-clip plugin")

from stitch_clip import CLIP_DEMO, CLIP_DEMO_VIDEO  # noqa: E402
from stitch_clip.video import (  # noqa: E402
    ClipVideoEncoder,
    FrameSampling,
    VideoError,
    clip_video_encoder,
    pool_frames,
    sample_frames,
)

QUESTION = "Which way does the ball move?"


def _graded_clip(path, frames: int = 8, fps: int = 8, size: int = 32) -> None:
    """An MP4 whose frame k is a flat grey of level 16 + 28 k (frame k shows at k / fps s)."""
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.options = {"qscale": "1"}
        for k in range(frames):
            image = np.full((size, size, 3), 16 + 28 * k, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _frame_indices(images) -> list[int]:
    return [round((float(np.asarray(image).mean()) - 16) / 28) for image in images]


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("clips") / "graded.mp4"
    _graded_clip(path)
    return path


def test_count_sampling_takes_the_frame_at_the_middle_of_each_equal_share(clip):
    # 1 s at 8 fps; 4 shares of 0.25 s, middles at 0.125, 0.375, 0.625, 0.875 s -> frames 1, 3, 5, 7
    assert _frame_indices(sample_frames(str(clip), FrameSampling(frames=4))) == [1, 3, 5, 7]
    assert _frame_indices(sample_frames(clip.read_bytes(), FrameSampling(frames=2))) == [2, 6]


def test_rate_sampling_takes_one_frame_every_one_over_fps_seconds_from_the_start(clip):
    assert _frame_indices(sample_frames(str(clip), FrameSampling(frames=3, fps=4))) == [0, 2, 4]
    assert _frame_indices(sample_frames({"bytes": clip.read_bytes()}, FrameSampling(frames=4, fps=8))) == [0, 1, 2, 3]


@pytest.mark.parametrize(("sampling", "data", "kind", "says"), [
    (FrameSampling(frames=8, fps=4), None, "video-too-short", "8 frames at 4 fps need more than 1.75 s"),
    (FrameSampling(frames=2, max_seconds=0.5), None, "video-too-long", "lasts 1.0 s; at most 0.5 s"),
    (FrameSampling(frames=2, max_pixels=100), None, "video-too-large", "32x32 = 1,024 pixels; at most 100"),
    (FrameSampling(frames=2), b"\x00\x00\x00\x18ftypmp42 not really a video", "corrupt-video", "not a decodable"),
])
def test_a_bad_clip_is_refused_with_its_kind_expected_and_actual(clip, sampling, data, kind, says):
    with pytest.raises(VideoError) as caught:
        sample_frames(data if data is not None else str(clip), sampling)
    assert caught.value.kind == kind and says in str(caught.value), str(caught.value)
    if data is None:
        assert str(clip) in str(caught.value)  # names the file


def test_without_pyav_a_clip_is_refused_naming_the_extra(clip, monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)  # import av raises ImportError
    with pytest.raises(VideoError, match=r"pip install 'stitch-clip\[video\]'"):
        sample_frames(str(clip), FrameSampling(frames=2))
    with pytest.raises(VideoError, match=r"stitch-clip\[video\]"):  # prepare loads this before reading a row
        CLIP_DEMO_VIDEO.load_preprocess(CLIP_DEMO_VIDEO.source)


class _CountingTower:
    """Stands in for a CLIP image encoder: feature of a frame = its mean pixel, 49 x 2; counts every frame."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        means = pixels.float().mean(dim=(1, 2, 3))
        self.seen += means.tolist()
        return means[:, None, None].expand(-1, 49, 2).clone()


def test_each_sampled_frame_is_encoded_once_and_pooling_averages_consecutive_frames():
    tower = _CountingTower()
    encoder = ClipVideoEncoder(tower, FrameSampling(frames=4, pool=2))
    clips = torch.arange(2 * 4, dtype=torch.uint8).reshape(2, 4, 1, 1, 1).expand(2, 4, 3, 4, 4).contiguous()
    features = encoder.encode(clips)
    assert sorted(tower.seen) == list(range(8)) and encoder.frames_encoded == 8  # every frame once, none twice
    assert features.shape == (2, 2 * 49, 2)
    assert features[0, 0, 0] == 0.5 and features[0, 49, 0] == 2.5 and features[1, 49, 0] == 6.5


@pytest.mark.parametrize(("frames", "pool", "groups"), [(4, 1, 4), (4, 2, 2), (5, 2, 3), (8, 8, 1)])
def test_temporal_pooling_gives_the_token_count_the_encoder_declares(frames, pool, groups):
    spec = clip_video_encoder(CLIP_DEMO, "probe", FrameSampling(frames=frames, pool=pool), "probe")
    assert spec.tokens_per_item == groups * 49 and spec.modality == "video"
    pooled = pool_frames(torch.randn(3, frames, 49, 8), pool)
    assert pooled.shape == (3, spec.tokens_per_item, 8)


def test_a_sentinel_set_without_video_tokens_refuses_a_video_encoder():
    plain = SentinelSpec("plain", "<a>", "<b>", "<c>")
    assert plain.for_modality("image") is plain
    with pytest.raises(SentinelLayoutError, match="declares no video_start/video_end"):
        plain.for_modality("video")


# -- the video layout in prompts, serving and preparation -----------------------------------------------------


@pytest.fixture(scope="module")
def video_inputs(tmp_path_factory):
    recipe = write_recipe(tmp_path_factory.mktemp("video") / "video.yaml", encoder="clip-demo-video")
    return prepare_inputs(load_recipe(recipe))


@pytest.fixture(scope="module")
def image_ids(tmp_path_factory):
    recipe = write_recipe(tmp_path_factory.mktemp("image") / "image.yaml", encoder="clip-demo")
    return prepare_inputs(load_recipe(recipe))["sentinel_ids"]


def test_a_clip_is_bracketed_by_video_sentinels_where_its_marker_stands(video_inputs, image_ids):
    image = image_ids
    ids, tokenizer = video_inputs["sentinel_ids"], video_inputs["tokenizer"]
    assert ids.marker == "<video>" and ids.placeholder == image.placeholder
    assert {ids.start, ids.end}.isdisjoint({image.start, image.end})  # the LM tells a clip from an image
    prompt = prompt_token_ids(tokenizer, f"Look: <video> {QUESTION}", ids, 98)
    start = prompt.index(ids.start)
    assert prompt[start + 99] == ids.end and prompt.count(ids.placeholder) == 98
    assert "Look:" in tokenizer.decode(prompt[:start]) and QUESTION in tokenizer.decode(prompt[start:])
    # an <image> marker and a typed sentinel stay text in a video row: only the <video> marker places the clip
    messages = [{"role": "user", "content": f"<image> <|quad_start|> <video> {QUESTION}"},
                {"role": "assistant", "content": "left"}]
    input_ids, _ = tokenize_example(tokenizer, messages, ids, 98, 1)
    assert input_ids.count(ids.start) == 1 and input_ids.count(image.start) == 0


def _data_url(path) -> str:
    return "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()


def test_serve_takes_a_video_url_part_and_renders_the_prompt_training_renders(video_inputs, clip):
    from stitch.host.host import get_host

    host = get_host()
    registered = [host.get("encoders", name) for name in host.names("encoders")]
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": _data_url(clip)}}, {"type": "text", "text": QUESTION}]}]}
    request = parse_chat_request(body, "m", CLIP_DEMO_VIDEO, registered, Limits())
    assert [part.kind for part in request.media] == ["video_url"] and request.media[0].data == clip.read_bytes()
    tokenizer, ids = video_inputs["tokenizer"], video_inputs["sentinel_ids"]
    served = conversation_prompt_ids(tokenizer, request.messages, ids, CLIP_DEMO_VIDEO.tokens_per_item)
    assert request.messages[0]["content"] == [MEDIA, QUESTION]
    assert served == prompt_token_ids(tokenizer, QUESTION, ids, CLIP_DEMO_VIDEO.tokens_per_item, 1)
    # an image part is not this encoder's: refused naming the encoder that takes it
    body["messages"][0]["content"][0] = {"type": "image_url", "image_url": {"url": _data_url(clip)}}
    with pytest.raises(RequestError, match="taken by encoder 'clip-"):
        parse_chat_request(body, "m", CLIP_DEMO_VIDEO, registered, Limits())


def test_prepare_encodes_each_clip_once_and_skips_a_bad_clip_naming_row_and_kind(tmp_path, clip):
    import json

    from stitch.data.prepare import prepare
    from stitch_clip.moving_ball import write_clip

    root = tmp_path / "dataset"
    (root / "clips").mkdir(parents=True)
    rows = []
    for i, direction in enumerate(["left", "right", "up", "down"]):
        write_clip(root / "clips" / f"{i}.mp4", direction, random.Random(i))
        rows.append({"id": f"c{i}", "video": f"clips/{i}.mp4", "question": QUESTION, "answer": direction})
    (root / "clips" / "broken.mp4").write_bytes(b"not a video at all")
    rows.insert(2, {"id": "broken", "video": "clips/broken.mp4", "question": QUESTION, "answer": "up"})
    rows.insert(3, {"id": "outside", "video": "../secret.mp4", "question": QUESTION, "answer": "up"})
    rows.insert(4, {"id": "twice", "video": "clips/0.mp4", "question": f"<video> or <video>? {QUESTION}",
                    "answer": "up"})
    (tmp_path / "secret.mp4").write_bytes(clip.read_bytes())
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = write_recipe(tmp_path / "video.yaml", encoder="clip-demo-video", data={
        "source": {"path": "dataset/rows.jsonl", "format": "json"},
        "columns": {"id": "id", "media": "video", "question": "question", "answer": "answer"},
        "partitions": {"train": [0, 4]}, "scan_cap": 7, "budgets": {"transient_mib": 64, "retained_mib": 16},
        "on_corrupt": "skip", "feature_dtype": "float16", "prepare": {"workers": 0}},
        stages={"sft": {"partition": "train", "eval_partition": None, "steps": 1, "batch_size": 1}})
    inputs = prepare_inputs(load_recipe(recipe))
    encoder = CLIP_DEMO_VIDEO.load(CLIP_DEMO_VIDEO.source, "cpu", torch.float16)
    report = prepare(load_recipe(recipe), tmp_path / "out", encoder=encoder, progress=False, **inputs)
    assert report.rows == {"train": 4} and report.items_encoded == 4
    assert encoder.frames_encoded == 4 * 4  # 4 clips x 4 sampled frames, each through the tower once
    skipped = {row["id"]: row["kind"] for row in report.skipped}
    assert skipped == {"broken": "corrupt-video", "outside": "path-outside", "twice": "image-count"}
    assert "broken.mp4" in report.skipped[0]["reason"]
    assert "2 <video> marker(s) in the text but 1 media item(s)" in report.skipped[2]["reason"]
    again = prepare(load_recipe(recipe), tmp_path / "out", encoder=encoder, progress=False, **inputs)
    assert again.items_encoded == 0 and encoder.frames_encoded == 16  # the cache answers a re-run


@pytest.fixture(scope="module")
def video_run(tmp_path_factory):
    """Four moving-ball clips prepared through clip-demo-video and trained one alignment and one SFT step."""
    from stitch.data.prepare import prepare
    from stitch.host.host import get_host
    from stitch.stages.loop import run_stage
    from stitch_clip.moving_ball import write_dataset

    root = tmp_path_factory.mktemp("video-run")
    write_dataset(root / "dataset", 4, seed=1)
    recipe = load_recipe(write_recipe(root / "video.yaml", encoder="clip-demo-video", task="exact-match", data={
        "source": {"path": "dataset/rows.jsonl", "format": "json"},
        "columns": {"id": "id", "media": "video", "question": "question", "answer": "answer"},
        "partitions": {"train": [0, 4]}, "scan_cap": 4, "budgets": {"transient_mib": 64, "retained_mib": 16},
        "feature_dtype": "float16", "prepare": {"workers": 0}},
        stages={"alignment": {"partition": "train", "eval_partition": None, "steps": 1, "batch_size": 1},
                "sft": {"partition": "train", "eval_partition": None, "steps": 1, "batch_size": 1},
                "grpo": {"partition": "train", "eval_partition": None, "steps": 1, "prompts_per_step": 2,
                         "group_size": 2, "max_new_tokens": 4}}))
    encoder = CLIP_DEMO_VIDEO.load(CLIP_DEMO_VIDEO.source, "cpu", torch.float16)
    prepare(recipe, root / "run" / "data", encoder=encoder, progress=False, **prepare_inputs(recipe))
    for stage in ("alignment", "sft"):
        run_stage(recipe, stage, root / "run", progress=False, registry=get_host())
    return recipe, root / "run"


def test_export_of_a_video_checkpoint_names_the_video_brackets_and_llava_refuses_it(video_run, tmp_path):
    from stitch.host.host import get_host
    from stitch.serve.export import export_checkpoint
    from stitch.serve.llava_export import LlavaExportError, export_llava

    _, run = video_run
    manifest = export_checkpoint(run / "sft" / "checkpoints", tmp_path / "export", get_host())
    assert manifest["encoder"]["modality"] == "video" and manifest["encoder"]["tokens_per_item"] == 98
    sentinels = manifest["sentinels"]
    assert (sentinels["start"], sentinels["end"]) == ("<|quad_start|>", "<|quad_end|>")  # not the image brackets
    assert manifest["prompt"]["media_block"].startswith("<|quad_start|>")
    assert "<video> marker" in manifest["prompt"]["media_position"]
    with pytest.raises(LlavaExportError, match="'clip-demo-video' encodes video"):
        export_llava(run / "sft" / "checkpoints", tmp_path / "llava", get_host())


def test_grpo_takes_one_step_on_video_prompts(video_run):
    from stitch.host.host import get_host
    from stitch.stages.loop import run_stage

    recipe, run = video_run
    summary = run_stage(recipe, "grpo", run, progress=False, registry=get_host())
    assert summary["steps"] == 1
