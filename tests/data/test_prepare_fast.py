"""The shipped prepare's fast path against the reference: uint8 geometry in workers (JPEG decoded at a reduced DCT
scale), normalisation on the encoder's device, sdpa over the truncated tower, decode workers; same rows, same
shards, features within stated tolerances of CLIPImageProcessor -> full eager tower ``hidden_states[-2]``."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

from stitch.config.recipe import load_recipe
from stitch.data.prepare_report import REPORT_NAME
from tests.stitch_testing import prepare_resolved

pytest.importorskip("stitch_clip", reason="the CLIP encoder comes from the stitch-clip plugin")

from stitch_clip.encoder import ClipGeometry, clip_geometry, decode_image  # noqa: E402
from tests.data.test_bad_data import hostile, hostile_recipe  # noqa: E402,F401  (hostile: the fixture, used by name)
from tests.data.test_prepare import dir_snapshot, write_recipe  # noqa: E402

# Measured (Pillow 13, torch 2.13, transformers 5.19, the sizes below): the geometry resizes on torch's uint8 kernels,
# PIL's filter in fixed point, so PNG pixels are within one uint8 level of the processor's (one level is 0.0150 in
# normalised units; measured max exactly one level, mean 7.0e-5, i.e. a level's difference in about 0.5 % of the
# pixels); a JPEG decoded by draft() at 1/2 or 1/4 scale differs from full decode + the processor by at most 0.10
# (about 7 of 255 levels) and 0.016 on average; JPEGs whose short side is under 448 px are not drafted and match
# like PNGs. Features (fp32, clip-tiny's random 2-layer tower): the processor's own pixels through the shipped tower
# (sdpa, truncated, the patch embedding as one GEMM) within 1.07e-5 of the eager full tower's hidden_states[-2] (the
# same 3,072 products summed in another order, on features of magnitude ~2); PNG through the shipped geometry within
# 0.13 % relative L2 per item; draft JPEG within 2.8 % (another image is ~135 % away). Tolerances leave headroom over
# what was measured.
ONE_LEVEL = 1 / 255 / 0.26130258 + 1e-6  # CLIP's smallest std
PNG_PIXEL_MEAN = 5e-4
JPEG_PIXEL_MAX, JPEG_PIXEL_MEAN = 0.12, 0.025
TOWER_FEATURE_ATOL = 2e-5
PNG_FEATURE_REL = 0.005
JPEG_FEATURE_REL = 0.04
SIZES = [(640, 480), (480, 640), (500, 375), (1024, 768), (1900, 1000), (300, 229)]


def photo_bytes(width: int, height: int, fmt: str, seed: int = 0) -> bytes:
    """Smooth waves + sensor noise: compresses like a photo (flat colour would hide resampling errors)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    waves = [np.sin(xx / rng.uniform(8, 40) + rng.uniform(0, 6)) * np.cos(yy / rng.uniform(8, 40)) * 100 + 128
             for _ in range(3)]
    pixels = np.stack(waves, -1) + rng.normal(0, 8, (height, width, 3))
    buf = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buf, fmt, quality=90)
    return buf.getvalue()


@pytest.fixture(scope="module")
def host_module():
    from stitch.host.host import load_plugins

    return load_plugins()


@pytest.fixture(scope="module")
def tiny(host_module):
    """The clip-tiny snapshot: its processor and the loaded (truncated, sdpa) encoder in fp32."""
    from transformers import CLIPImageProcessor

    spec = host_module.get("encoders", "clip-tiny")
    kwargs = spec.source.pretrained_kwargs()
    return CLIPImageProcessor.from_pretrained(**kwargs), spec.load(spec.source, "cpu", torch.float32), kwargs


def reference_pixels(processor, raw: bytes) -> torch.Tensor:
    return processor(images=[decode_image(raw)], return_tensors="pt")["pixel_values"]


def fast_pixels(encoder, geometry: ClipGeometry, raw: bytes) -> torch.Tensor:
    return encoder.normalise(geometry(raw)[None])


def reference_features(kwargs, pixels: torch.Tensor) -> torch.Tensor:
    """Stock transformers: eager attention, the whole tower, the penultimate hidden state's patch tokens."""
    from transformers import CLIPVisionModel

    model = CLIPVisionModel.from_pretrained(**kwargs, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(pixel_values=pixels, output_hidden_states=True).hidden_states[-2][:, 1:]


def pixel_errors(processor, encoder, geometry, fmt: str) -> tuple[float, float]:
    diffs = [(fast_pixels(encoder, geometry, raw) - reference_pixels(processor, raw)).abs()
             for raw in (photo_bytes(w, h, fmt, seed=i) for i, (w, h) in enumerate(SIZES))]
    return max(d.max().item() for d in diffs), max(d.mean().item() for d in diffs)


def test_png_fast_pixels_stay_within_one_uint8_level_of_clip_image_processor(tiny):
    processor, encoder, _ = tiny
    assert abs(ONE_LEVEL - 1 / 255 / min(processor.image_std)) < 1e-5
    worst, mean = pixel_errors(processor, encoder, clip_geometry(processor), "PNG")
    assert worst <= ONE_LEVEL and mean <= PNG_PIXEL_MEAN, (worst, mean)


def test_draft_jpeg_fast_pixels_stay_within_the_measured_tolerance_of_full_decode(tiny):
    processor, encoder, _ = tiny
    worst, mean = pixel_errors(processor, encoder, clip_geometry(processor), "JPEG")
    assert worst <= JPEG_PIXEL_MAX and mean <= JPEG_PIXEL_MEAN, (worst, mean)
    assert worst > 2 * ONE_LEVEL  # the draft path was taken: full decode would match as PNG does


def test_a_draft_below_the_resize_target_breaks_the_jpeg_pixel_tolerance(tiny):
    processor, encoder, _ = tiny
    good = clip_geometry(processor)

    class TooAggressive(ClipGeometry):  # decodes at 1/8 and then upsamples: the mutation the check must catch
        def __call__(self, value):
            image = decode_image(value, min_short_side=self.shortest_edge // 4)
            buf = io.BytesIO()
            image.save(buf, "PNG")
            return super().__call__(buf.getvalue())

    worst, mean = pixel_errors(processor, encoder, TooAggressive(good.shortest_edge, good.crop, good.resample), "JPEG")
    assert worst > JPEG_PIXEL_MAX or mean > JPEG_PIXEL_MEAN


def test_wrong_normalisation_on_the_device_breaks_the_png_pixel_identity(tiny):
    processor, encoder, _ = tiny
    geometry = clip_geometry(processor)
    saved = encoder.std
    try:
        encoder.std = encoder.mean  # a swapped constant, the classic slip
        worst, _ = pixel_errors(processor, encoder, geometry, "PNG")
    finally:
        encoder.std = saved
    assert worst > JPEG_PIXEL_MAX


def test_fast_features_match_the_full_eager_tower_penultimate_layer_for_png_and_draft_jpeg(tiny):
    processor, encoder, kwargs = tiny
    geometry = clip_geometry(processor)
    png = [photo_bytes(w, h, "PNG", seed=i) for i, (w, h) in enumerate(SIZES[:3])]
    jpeg = [photo_bytes(w, h, "JPEG", seed=i) for i, (w, h) in enumerate(SIZES[:3])]
    raws = png + jpeg
    reference = reference_features(kwargs, torch.cat([reference_pixels(processor, r) for r in raws]))
    tower = encoder.encode([decode_image(r) for r in png])  # the processor's own pixels through the shipped tower
    assert (tower - reference[:3]).abs().max().item() <= TOWER_FEATURE_ATOL
    fast = encoder.encode(torch.stack([geometry(r) for r in raws]))
    assert fast.shape == reference.shape == (len(raws), 49, 768)

    def relative(a, b):
        return ((a - b).norm(dim=(1, 2)) / b.norm(dim=(1, 2))).max().item()

    assert relative(fast[:3], reference[:3]) <= PNG_FEATURE_REL
    assert relative(fast[3:], reference[3:]) <= JPEG_FEATURE_REL
    assert relative(fast[3:], reference[3:].roll(1, 0)) > 10 * JPEG_FEATURE_REL  # another image: the check can fail


def test_padded_batches_of_a_compiled_encoder_give_the_unpadded_features(tiny):
    processor, encoder, _ = tiny
    geometry = clip_geometry(processor)
    batch = torch.stack([geometry(photo_bytes(w, h, "JPEG", seed=i)) for i, (w, h) in enumerate(SIZES[:3])])
    plain = encoder.encode(batch)
    encoder.compiled_batch = 2  # the padding/chunking of a compiled tower, without paying for a CPU compile
    try:
        padded = encoder.encode(batch)  # one chunk of 2, one of 1 padded to 2
    finally:
        encoder.compiled_batch = None
    torch.testing.assert_close(padded, plain, atol=1e-5, rtol=1e-5)


def test_shards_and_manifest_are_bitwise_equal_with_0_and_2_decode_workers_through_slots_or_segments(
        tmp_path, host_module, monkeypatch):
    """In-process decode, workers writing into shared slots, and workers left with one slot for five chunks of 4
    rows, one chunk ahead (the slot is taken again once a flushed shard's rows let go of it; a chunk that finds it
    taken travels as a segment of its own): one output."""
    from stitch.kernels import prepare_workers
    from stitch.kernels.shared_slots import SharedSlots

    def one_slot(preprocess, workers, shard_rows):
        ring = media_slots(preprocess, workers, shard_rows)
        return ring and SharedSlots(1, ring.slot_bytes)

    media_slots = prepare_workers.media_slots
    snapshots, chunks = [], []
    for workers, slots in ((0, None), (2, None), (2, 1)):
        root = tmp_path / f"w{workers}-{slots}"
        root.mkdir()
        if slots:
            monkeypatch.setattr(prepare_workers, "media_slots", one_slot)
            monkeypatch.setattr(prepare_workers, "MEDIA_CHUNK_ROWS", 4)
            monkeypatch.setattr(prepare_workers, "chunks_ahead", lambda workers, shard_rows: 1)
        data = {"source": {"builtin": "counting-shapes", "rows": 20, "caption_rows": 4, "seed": 0},
                "partitions": {"alignment": [0, 6], "train": [6, 20]}, "scan_cap": 24, "shard_rows": 5,
                "encode_batch_size": 3, "prepare": {"workers": workers}}
        report = prepare_resolved(load_recipe(write_recipe(root, **data)), root / "out", host=host_module, progress=False)
        assert report.rows == {"alignment": 6, "train": 14} and report.shards_encoded == 4 + 1
        snapshots.append(dir_snapshot(root / "out"))
        chunks.append(report.media_chunks)
    assert snapshots[0] == snapshots[1] == snapshots[2]
    assert chunks[0] == {"shared_slot": 0, "own_segment": 0}
    assert chunks[1] == {"shared_slot": 1, "own_segment": 0}  # 20 rows: one chunk of 64
    assert chunks[2]["shared_slot"] >= 2 and chunks[2]["own_segment"] >= 1  # the slot was reused, and ran out
    assert sum(chunks[2].values()) == 5


def test_hostile_rows_are_reported_identically_with_0_and_2_decode_workers(hostile, tmp_path, host_module):  # noqa: F811
    root = hostile
    reports = []
    for workers in (0, 2):
        out = tmp_path / f"out{workers}"
        prepare_resolved(load_recipe(hostile_recipe(root, name=f"w{workers}", prepare={"workers": workers})), out,
                host=host_module, progress=False)
        report = json.loads((out / REPORT_NAME).read_text())
        reports.append((report["rows"], report["skipped"], dir_snapshot(out)))
    assert reports[0] == reports[1] and reports[0][1]


def test_served_images_are_preprocessed_as_prepare_preprocessed_the_training_images(tiny, host_module):
    """stitch serve / infer encode an image through the encoder's prepare preprocessing (a large JPEG decoded by
    draft()), so a served image gets the features its training twin got, not the full-decode processor's."""
    from stitch.serve.inference import encode_item

    processor, encoder, _ = tiny
    spec = host_module.get("encoders", "clip-tiny")
    preprocess = spec.preprocess()
    raw = photo_bytes(1024, 768, "JPEG", seed=3)  # short side >= 448: drafted at 1/2 scale
    served = encode_item(spec, encoder, preprocess, raw)
    prepared = encoder.encode(torch.stack([preprocess(raw)])).float()
    assert torch.equal(served, prepared)
    full_decode = encoder.encode([decode_image(raw)]).float()
    assert not torch.equal(served, full_decode)  # the two paths differ here, so the test tells them apart


def test_patch_embedding_as_one_gemm_equals_the_stride_32_conv_it_replaces(tiny):
    from stitch_clip.fast import PatchGemm

    _, encoder, _ = tiny
    gemms = [m for m in encoder.model.modules() if type(m) is PatchGemm]
    assert len(gemms) == 1  # the shipped encoder computes its patches as one GEMM
    gemm = gemms[0]
    conv = torch.nn.Conv2d(3, gemm.out_channels, 32, stride=32, bias=gemm.bias is not None)
    conv.load_state_dict(gemm.state_dict())
    pixels = torch.randn(3, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = conv(pixels), gemm(pixels)
    assert got.shape == want.shape == (3, gemm.out_channels, 7, 7)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    with torch.no_grad():  # a size the kernel does not tile takes the stock conv
        torch.testing.assert_close(gemm(pixels[:, :, :100, :100]), conv(pixels[:, :, :100, :100]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side-stream copy needs a CUDA device")
def test_on_a_gpu_a_batch_copied_in_chunks_on_a_side_stream_gives_the_one_copy_features(host_module):
    spec = host_module.get("encoders", "clip-tiny")
    encoder = spec.load(spec.source, "cuda", torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (1100, 3, 224, 224), dtype=torch.uint8, generator=generator).pin_memory()
    encoder.pipeline_chunk = None  # one copy, then the tower
    whole = encoder.encode(pixels).float()
    assert encoder._copied_ahead._stream is None
    encoder.pipeline_chunk = 512  # chunks of 512, 512 and 76, each copy on the side stream
    chunked = encoder.encode(pixels).float()
    assert encoder._copied_ahead._stream is not None and chunked.shape == whole.shape == (1100, 49, 768)

    def relative(a, b):
        return ((a - b).norm(dim=(1, 2)) / b.norm(dim=(1, 2))).max().item()

    assert relative(chunked, whole) <= 1e-2  # bf16: another batch size may pick other GEMM tiles
    assert relative(chunked, whole.roll(1, 0)) > 0.1  # another image's features: the check can fail
    encoder.pipeline_chunk = 2048  # one chunk, copied on the side stream: the same kernels on the same pixels
    assert torch.equal(encoder.encode(pixels).float(), whole)
