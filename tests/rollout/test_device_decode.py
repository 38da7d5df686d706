"""prepare's JPEG decode on the encoder's device (``ClipDeviceGeometry``): the worker hands over a JPEG's bytes only
where the GPU decodes it as the CPU would, the batched resize + crop is torch's antialiased bicubic (PIL's filter) to
within float rounding, a batch keeps its rows' order, ``data.prepare.decode`` picks the path (``device`` is refused
where there is none), and a whole prepare run through the device path (its decode done by PIL here, nvjpeg on a
GPU) gives the features of its own pixels."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from stitch.config.recipe import load_recipe
from stitch.data.prepare import preprocess_for
from tests.stitch_testing import prepare_resolved

pytest.importorskip("stitch_clip", reason="the CLIP encoder comes from the stitch-clip plugin")

import stitch_clip.encoder as clip_encoder  # noqa: E402
import stitch_clip.nvjpeg as nvjpeg  # noqa: E402
from stitch_clip.encoder import ClipGeometry  # noqa: E402
from stitch_clip.nvjpeg import ClipDeviceGeometry, JpegItem  # noqa: E402
from tests.data.test_prepare import dir_snapshot  # noqa: E402
from tests.data.test_prepare_fast import photo_bytes  # noqa: E402

GEOMETRY = ClipGeometry(224, (224, 224), 3)  # CLIP's: shortest edge 224, centre crop 224, bicubic
SIZES = [(640, 427), (427, 640), (500, 375), (224, 300), (301, 224), (640, 640), (300, 229)]


def pil_decode(datas, device):
    """What nvjpeg does on a GPU, done by PIL: full-size uint8 [3, h, w] images."""
    from PIL import Image

    return [torch.from_numpy(np.asarray(Image.open(io.BytesIO(bytes(d))).convert("RGB")).copy()).permute(2, 0, 1)
            .to(device) for d in datas]


def device_geometry(monkeypatch=None) -> ClipDeviceGeometry:
    geometry = ClipDeviceGeometry(GEOMETRY, decoder_version="test")
    if monkeypatch is not None:
        monkeypatch.setattr(geometry, "decode_jpegs", pil_decode)
    return geometry


def reference_resize_crop(image: torch.Tensor) -> torch.Tensor:
    """One image through torch's float antialiased bicubic resize, then the centre crop, rounded."""
    _, h, w = image.shape
    out_w, out_h = (224, int(224 * h / w)) if w <= h else (int(224 * w / h), 224)
    x = F.interpolate(image[None].double(), size=(out_h, out_w), mode="bicubic", antialias=True)[0]
    top, left = (out_h - 224) // 2, (out_w - 224) // 2
    return x[:, top : top + 224, left : left + 224].round().clamp(0, 255).to(torch.uint8)


def random_images(sizes, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=generator) for w, h in sizes]


def test_batched_resize_crop_of_mixed_sizes_is_torchs_antialiased_bicubic_to_within_rounding():
    """Noise of seven sizes (landscape, portrait, square, a short side already 224) resized in one batched product:
    every pixel within one level of torch's own float resize of each image alone, nearly all equal."""
    images = random_images(SIZES)
    got = device_geometry().resize_crop(images, torch.device("cpu"))
    want = torch.stack([reference_resize_crop(image) for image in images])
    assert got.shape == (len(SIZES), 3, 224, 224) and got.dtype == torch.uint8
    diff = (got.int() - want.int()).abs()
    assert diff.max() <= 1  # float32 products against float64: a rounding tie at most
    assert diff.float().mean() < 1e-3


@pytest.mark.parametrize("resample, mode", [(3, "bicubic"), (2, "bilinear")])
def test_the_closed_form_resize_weights_are_torchs_antialiased_filter_rounded_to_float32(resample, mode):
    """Every image's row and column weights in one closed-form computation (no matrix per size): for downscales
    small and large, upscales, scale 1 and a crop offset, the float32 weights are torch's float64 resize of an
    identity matrix rounded to float32 (to a unit in the last place), and zero beyond the image's own size. Bilinear
    too: the processor's filter is the one the device computes."""
    cases = [(480, 224, 0), (640, 298, 37), (224, 224, 0), (100, 224, 0), (57, 224, 0), (4000, 224, 0),
             (225, 224, 0), (427, 320, 48), (1000, 999, 387)]
    size = max(n_in for n_in, _, _ in cases) + 3
    taps = 2 * int(np.ceil(nvjpeg.AA_HALF_WIDTH[resample] * max(n / o for n, o, _ in cases))) + 1
    got = nvjpeg.resize_weights(torch.tensor(cases), 224, size, taps, resample)
    assert got.shape == (len(cases), 224, size) and got.dtype == torch.float32
    for (n_in, n_out, start), weights in zip(cases, got, strict=True):
        eye = torch.eye(n_in, dtype=torch.float64)[None, None]
        want = F.interpolate(eye, size=(n_in, n_out), mode=mode, antialias=True)[0, 0, :, start : start + 224].T
        assert torch.equal(weights[:, n_in:], torch.zeros(224, size - n_in))
        ulp = torch.finfo(torch.float32).eps * want.abs() + 1e-15  # a filter's exact zeros: ~1e-16 either way
        assert ((weights[:, :n_in].double() - want).abs() <= ulp).all(), (n_in, n_out, start)


def test_device_pixels_of_a_photo_stay_within_a_level_of_the_workers_uint8_geometry_on_average():
    """The same decoded photo through the batched float resize and through the workers' fixed-point uint8 resize
    (``ClipGeometry``; no DCT scaling below a 448-px short side): close, not equal."""
    raws = [photo_bytes(w, h, "JPEG", seed=i) for i, (w, h) in enumerate(SIZES[:3])]
    got = device_geometry().resize_crop(pil_decode(raws, "cpu"), torch.device("cpu")).int()
    want = torch.stack([GEOMETRY(raw) for raw in raws]).int()
    assert (got - want).abs().float().mean() < 0.5
    assert ((got - want).abs() > 2).float().mean() < 0.01


def test_the_worker_hands_over_only_whole_upright_rgb_jpegs_and_decodes_the_rest_itself(tmp_path):
    from PIL import Image

    geometry = device_geometry()
    jpeg = photo_bytes(500, 375, "JPEG", seed=1)
    item = geometry(jpeg)
    assert isinstance(item, JpegItem) and bytes(item.data) == jpeg and (item.width, item.height) == (500, 375)
    assert geometry({"bytes": jpeg, "path": "ignored.jpg"}) == item  # bytes win over a path, as everywhere
    path = tmp_path / "photo.jpg"
    path.write_bytes(jpeg)
    # a file's path travels instead of its bytes (no 65 KB through the pipe), and reads back to the same bytes
    by_path = geometry(str(path))
    assert by_path == JpegItem(str(path), 500, 375) == geometry({"bytes": None, "path": str(path)})
    assert by_path.read() == item.read() == bytearray(jpeg)

    png = photo_bytes(500, 375, "PNG", seed=1)
    grey, rotated = io.BytesIO(), io.BytesIO()
    Image.open(io.BytesIO(jpeg)).convert("L").save(grey, "JPEG")
    exif = Image.Exif()
    exif[0x0112] = 6  # stored on its side: the CPU turns it upright, nvjpeg would not
    Image.open(io.BytesIO(jpeg)).save(rotated, "JPEG", exif=exif)
    for other in (png, grey.getvalue(), rotated.getvalue()):
        item = geometry(other)
        assert isinstance(item, torch.Tensor) and torch.equal(item, GEOMETRY(other))
    assert geometry(rotated.getvalue()).shape == (3, 224, 224)
    with pytest.raises(ValueError, match="cannot decode"):  # truncated: the CPU's decode reports it, as before
        geometry(jpeg[: len(jpeg) // 2])


def test_a_device_batch_keeps_its_rows_order_across_chunks_and_cpu_decoded_items(monkeypatch):
    geometry = device_geometry(monkeypatch)
    monkeypatch.setattr(ClipDeviceGeometry, "DEVICE_CHUNK", 2)
    raws = [photo_bytes(w, h, "JPEG", seed=i) for i, (w, h) in enumerate(SIZES[:5])]
    items = [geometry(raw) for raw in raws]
    items[2] = GEOMETRY(raws[2])  # as the worker hands over an image the GPU does not decode
    batch = geometry.device_batch(items, "cpu")
    alone = [geometry.resize_crop(pil_decode([raw], "cpu"), torch.device("cpu"))[0] for raw in raws]
    assert torch.equal(batch[2], GEOMETRY(raws[2]))
    for i in (0, 1, 3, 4):
        assert torch.equal(batch[i], alone[i])
    assert not torch.equal(batch[0], batch[1])


def test_the_next_chunk_is_read_and_decoded_on_the_decode_thread_while_this_one_resizes(monkeypatch):
    """Chunks of two: the first chunk's resize waits (at most 20 s) until the second chunk's decode has begun on
    another thread. Decoding each chunk only after the resize before it, on one thread, never gets there."""
    import threading

    geometry = device_geometry(monkeypatch)
    monkeypatch.setattr(ClipDeviceGeometry, "DEVICE_CHUNK", 2)
    raws = [photo_bytes(w, h, "JPEG", seed=i) for i, (w, h) in enumerate(SIZES[:4])]
    decodes: list[str] = []
    second_began = threading.Event()

    def decode(datas, device):
        decodes.append(threading.current_thread().name)
        if len(decodes) == 2:
            second_began.set()
        return pil_decode(datas, device)

    resize = geometry.resize_crop
    waited: list[bool] = []

    def resize_crop(images, device):
        if not waited:
            waited.append(second_began.wait(20))
        return resize(images, device)

    geometry.check_decoder(torch.device("cpu"))  # its one decode done: only the chunks' are counted
    monkeypatch.setattr(geometry, "decode_jpegs", decode)
    monkeypatch.setattr(geometry, "resize_crop", resize_crop)
    batch = geometry.device_batch([geometry(raw) for raw in raws], "cpu")
    assert waited == [True]
    assert len(decodes) == 2 and all(name.startswith("stitch-jpeg-decode") for name in decodes)
    for i, raw in enumerate(raws):  # and every image where it belongs
        assert torch.equal(batch[i], resize(pil_decode([raw], "cpu"), torch.device("cpu"))[0])


def test_jpegs_are_resized_in_size_ordered_chunks_within_the_pixel_budget(monkeypatch):
    geometry = device_geometry()
    monkeypatch.setattr(ClipDeviceGeometry, "PIXEL_BUDGET", 3 * 640 * 480)
    sizes = [(640, 480), (300, 229), (4000, 3000), (640, 427), (301, 224), (500, 375), (640, 480)]
    items = [JpegItem(bytearray(), w, h) for w, h in sizes]
    chunks = geometry.chunks(items, list(range(len(items))))
    assert sorted(i for chunk in chunks for i in chunk) == list(range(len(items)))
    assert [2] in chunks  # larger than the budget: alone
    for chunk in chunks:
        height, width = max(sizes[i][1] for i in chunk), max(sizes[i][0] for i in chunk)
        assert len(chunk) == 1 or len(chunk) * height * width <= 3 * 640 * 480
    areas = [sizes[i][0] * sizes[i][1] for chunk in chunks for i in chunk]
    assert areas == sorted(areas)  # similar sizes together: little padding


@pytest.mark.parametrize("held", ["bytes", "path", "slot"])
def test_a_jpeg_nvjpeg_refuses_goes_through_the_cpu_geometry_and_the_rest_of_its_chunk_stays_on_the_device(
        monkeypatch, tmp_path, held):
    """Whether a JPEG's bytes came with its row, stay in its file, or arrived in a decode worker's shared slot
    (a view of the ring: ``hand_over`` then ``take_over``)."""
    from stitch.kernels.shared_slots import SharedSlots

    geometry = device_geometry(monkeypatch)
    raws = [photo_bytes(w, h, "JPEG", seed=i) for i, (w, h) in enumerate(SIZES[:3])]
    items = [geometry(raw) for raw in raws]
    if held == "path":
        for i, raw in enumerate(raws):
            (tmp_path / f"{i}.jpg").write_bytes(raw)
        items = [geometry(str(tmp_path / f"{i}.jpg")) for i in range(len(raws))]
    elif held == "slot":
        ring = SharedSlots(1, 1 << 20)
        writer = ring.writer(ring.acquire())
        sent = geometry.hand_over(items, writer.put)
        items = geometry.take_over(sent, ring.take_payloads(writer.ref()))
        assert all(isinstance(item.data, np.ndarray) for item in items)

    def refuse_the_second(datas, device):
        if any(bytes(d) == raws[1] for d in datas):
            raise RuntimeError("nvjpeg: unsupported")
        return pil_decode(datas, device)

    monkeypatch.setattr(geometry, "decode_jpegs", refuse_the_second)
    batch = geometry.device_batch(items, "cpu")
    assert torch.equal(batch[1], GEOMETRY(raws[1]))
    for i in (0, 2):
        assert torch.equal(batch[i], geometry.resize_crop(pil_decode([raws[i]], "cpu"), torch.device("cpu"))[0])


def test_a_device_without_a_working_nvjpeg_stops_the_first_batch_with_the_remedy(monkeypatch):
    geometry = device_geometry()

    def broken(datas, device):
        raise RuntimeError("torchvision was not compiled with nvjpeg")

    monkeypatch.setattr(geometry, "decode_jpegs", broken)
    with pytest.raises(RuntimeError, match="nvjpeg cannot decode.*data.prepare.decode: cpu"):
        geometry.device_batch([geometry(photo_bytes(500, 375, "JPEG"))], "cpu")


def test_decode_device_takes_the_device_variant_on_cuda_cpu_keeps_the_workers_and_elsewhere_device_is_refused(
        monkeypatch):
    import importlib.util

    from stitch.data.prepare import PrepareError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "torchvision"
                        else found(name, *a))
    monkeypatch.setattr("importlib.metadata.version", lambda name: "0.0-test")
    on_gpu = preprocess_for(GEOMETRY, "cuda:0", "device")
    assert isinstance(on_gpu, ClipDeviceGeometry) and on_gpu.cpu is GEOMETRY
    assert on_gpu.identity != GEOMETRY.identity and "0.0-test" in on_gpu.identity
    assert preprocess_for(GEOMETRY, "cuda:0", "cpu") is GEOMETRY
    assert preprocess_for(None, "cuda:0", "cpu") is None
    with pytest.raises(PrepareError, match="has no variant"):  # an encoder with no fixed-shape preprocessing
        preprocess_for(None, "cuda:0", "device")
    lanczos = ClipGeometry(224, (224, 224), 1)  # a filter the device does not compute: the workers' PIL keeps it
    with pytest.raises(PrepareError, match="has no variant.*bilinear or bicubic"):
        preprocess_for(lanczos, "cuda:0", "device")
    with pytest.raises(ValueError, match="bilinear .2. or bicubic .3. filter, not resample=1"):
        ClipDeviceGeometry(lanczos)
    with pytest.raises(PrepareError, match="data.prepare.decode: device.*'cpu'.*decode: cpu"):
        preprocess_for(GEOMETRY, "cpu", "device")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchvision"
                        else found(name, *a))
    with pytest.raises(PrepareError, match="torchvision"):
        preprocess_for(GEOMETRY, "cuda:0", "device")


def jpeg_rows(root, n: int) -> None:
    (root / "imgs").mkdir()
    with open(root / "rows.jsonl", "w") as fh:
        for i in range(n):
            w, h = SIZES[i % len(SIZES)]
            (root / "imgs" / f"{i}.jpg").write_bytes(photo_bytes(w, h, "JPEG", seed=i))
            fh.write(json.dumps({"id": f"r{i}", "image": f"imgs/{i}.jpg", "question": "What is shown?",
                                 "answer": str(i)}) + "\n")


def jpeg_recipe(root, workers: int, decode: str = "device"):
    import yaml

    recipe = {"name": "device-decode", "model": "qwen3.5-tiny", "encoder": "clip-tiny",
              "data": {"source": {"path": str(root / "rows.jsonl"), "format": "json"},
                       "columns": {"id": "id", "media": "image", "question": "question", "answer": "answer"},
                       "partitions": {"train": [0, 10]}, "scan_cap": 10,
                       "budgets": {"transient_mib": 64, "retained_mib": 16}, "shard_rows": 4,
                       "encode_batch_size": 3, "prepare": {"workers": workers, "decode": decode}}}
    path = root / f"recipe-{workers}-{decode}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return load_recipe(path)


def test_prepare_through_the_device_path_encodes_what_device_batch_makes_with_or_without_workers(
        tmp_path, host, monkeypatch):
    """``decode: device`` with the device variant allowed on the CPU (its decode by PIL): JPEGs cross from the
    workers unstacked, their bytes in the chunk's shared slot (the main process reads no file again) or, without
    a slot, as their paths; the encoder gets ``device_batch``'s pixels, the shards are keyed by its identity, and
    0 or 2 workers, with a slot or without, write the same bytes. ``decode: cpu`` in the same setting keeps the
    workers' geometry: other shards."""
    from stitch.data.feature_cache import PreparedData
    from stitch.kernels import prepare_workers

    monkeypatch.setattr(ClipGeometry, "on_device", lambda self, device: device_geometry(monkeypatch))
    arrived: list[str] = []  # what each JPEG item's data is when device_batch gets it
    batch = ClipDeviceGeometry.device_batch

    def recording(self, items, device):
        arrived.extend(type(item.data).__name__ for item in items if isinstance(item, JpegItem))
        return batch(self, items, device)

    monkeypatch.setattr(ClipDeviceGeometry, "device_batch", recording)
    jpeg_rows(tmp_path, 10)
    outs, media_slots = [], prepare_workers.media_slots
    for workers, slots, chunks, data in ((0, True, 0, "str"), (2, True, 1, "ndarray"), (2, False, 0, "str")):
        out = tmp_path / f"out{workers}-{slots}"
        monkeypatch.setattr(prepare_workers, "media_slots", media_slots if slots else lambda *args: None)
        arrived.clear()
        report = prepare_resolved(jpeg_recipe(tmp_path, workers), out, host=host, progress=False)
        assert report.rows == {"train": 10} and report.media_chunks == {"shared_slot": chunks, "own_segment": 0}
        assert arrived == [data] * 10, (workers, slots, arrived)
        outs.append(out)
    assert dir_snapshot(outs[0]) == dir_snapshot(outs[1]) == dir_snapshot(outs[2])

    spec = host.get("encoders", "clip-tiny")
    encoder = spec.load(spec.source, "cpu", torch.float32)
    geometry = device_geometry(monkeypatch)
    raws = [(tmp_path / "imgs" / f"{i}.jpg").read_bytes() for i in range(10)]
    want = encoder.encode(geometry.device_batch([geometry(raw) for raw in raws], "cpu"))
    data = PreparedData(outs[0])
    got = torch.stack([data.features(row)[0] for row in data.rows()])
    torch.testing.assert_close(got.float(), want.float(), atol=1e-5, rtol=1e-5)

    cpu_out = tmp_path / "out-cpu"
    prepare_resolved(jpeg_recipe(tmp_path, 0, "cpu"), cpu_out, host=host, progress=False)
    device_shards = {p.name for p in outs[0].rglob("*.safetensors")}
    cpu_shards = {p.name for p in cpu_out.rglob("*.safetensors")}
    assert len(cpu_shards) == len(device_shards) == 3 and cpu_shards.isdisjoint(device_shards)


def recorded_device_run(tmp_path, host, monkeypatch, hold_encoder_until: str):
    """A fresh device-path run whose geometry records (call, thread) and whose encoder's ``warm_up`` (in the loader
    thread, after ``load``) waits, for at most 20 s, until the geometry's ``hold_encoder_until`` call has begun:
    whatever needs the loaded encoder first can then not have happened yet. Returns the events and whether the
    wait ended by that call (not by the timeout)."""
    import threading

    events: list[tuple[str, str]] = []
    begun = {name: threading.Event() for name in ("warm_up", "device_batch", "check_decoder")}
    geometry = device_geometry(monkeypatch)

    def recording(name, fn):
        def call(*args, **kwargs):
            events.append((name, threading.current_thread().name))
            begun[name].set()
            return fn(*args, **kwargs)
        return call

    for name in begun:
        monkeypatch.setattr(geometry, name, recording(name, getattr(geometry, name)))
    monkeypatch.setattr(ClipGeometry, "on_device", lambda self, device: geometry)
    held: list[bool] = []
    monkeypatch.setattr(clip_encoder.ClipImageEncoder, "warm_up",
                        lambda self, batch_size: held.append(begun[hold_encoder_until].wait(20)))
    jpeg_rows(tmp_path, 10)
    prepare_resolved(jpeg_recipe(tmp_path, 1), tmp_path / "out", host=host, progress=False)
    assert geometry._checked
    return events, held


def test_a_fresh_device_run_sets_the_decoder_up_in_its_own_thread_while_the_encoder_still_loads(
        tmp_path, host, monkeypatch):
    """nvjpeg's set-up (``warm_up``: one JPEG decoded and resized, ~0.85 s on the H200) runs in a thread of its own
    that starts with the encoder's loader, not after the encoder's warm-up in the loader thread: the encoder's
    warm-up here ends only once the decoder's has begun. Its check leaves nothing to decode again on the first
    batch."""
    events, held = recorded_device_run(tmp_path, host, monkeypatch, "warm_up")
    assert held == [True]  # serial (decoder after encoder, one thread): the wait times out
    assert events[0][0] == "warm_up" and events[0][1].startswith("stitch-inputs-warm-up")
    assert events[1] == ("check_decoder", events[0][1])  # the warm-up decoded: the check is done
    batches = [thread for name, thread in events if name == "device_batch"]
    assert batches and all(thread.startswith("stitch-encode") for thread in batches)


def test_the_first_device_batch_is_made_while_the_encoder_still_loads(tmp_path, host, monkeypatch):
    """The encode thread makes the first batch's input (nvjpeg decode and resize) before it waits for the
    encoder: the encoder's warm-up here ends only once that batch has begun."""
    events, held = recorded_device_run(tmp_path, host, monkeypatch, "device_batch")
    assert held == [True]  # the encoder waited for before the first input is made: the wait times out
    first = next(thread for name, thread in events if name == "device_batch")
    assert first.startswith("stitch-encode")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="nvjpeg decodes on a CUDA device")
def test_on_a_gpu_nvjpeg_pixels_stay_near_the_workers_and_its_features_near_theirs(host):
    pytest.importorskip("torchvision", reason="nvjpeg comes through torchvision")
    geometry = GEOMETRY.on_device("cuda")
    assert isinstance(geometry, ClipDeviceGeometry)
    raws = [photo_bytes(w, h, "JPEG", seed=i) for i, (w, h) in enumerate(SIZES)]
    items = [geometry(raw) for raw in raws]
    assert all(isinstance(item, JpegItem) for item in items)
    got = geometry.device_batch(items, "cuda").cpu()
    cpu = torch.stack([GEOMETRY(raw) for raw in raws])
    diff = (got.int() - cpu.int()).abs().float()
    assert diff.mean() < 1.5 and (diff > 10).float().mean() < 0.01, (float(diff.mean()), float((diff > 10).float().mean()))
    spec = host.get("encoders", "clip-tiny")
    encoder = spec.load(spec.source, "cuda", torch.float32)
    a, b = encoder.encode(got.cuda()).flatten(1), encoder.encode(cpu.cuda()).flatten(1)
    assert float(F.cosine_similarity(a, b).min()) > 0.995
    assert nvjpeg.device_decodable(raws[0])
