"""CLIP's preprocessing finished on the GPU: JPEGs handed over from prepare's workers through shared slots, decoded
by nvjpeg and resized + centre-cropped there in batched GEMMs; the reference is ``ClipGeometry`` on the CPU."""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import math
import os
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from stitch.accel import SlotBytes
from stitch_clip.media import media_bytes, unwrap

# ClipDeviceGeometry.resize_crop pads a chunk of images through a (strided) nested tensor, whose use torch marks as a
# prototype with a warning on every first use; the one call it makes is stable since torch 1.13
warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype stage", category=UserWarning)


class JpegItem(NamedTuple):
    """A JPEG handed from a worker to the device: its bytes, or the path of the file holding them, and its size
    from the headers (to chunk by pixels). Between processes its bytes travel in the chunk's shared slot
    (``ClipDeviceGeometry.hand_over``: ``data`` is then a ``SlotBytes`` in the worker and a uint8 view of the
    slot in the main process), or, where they do not fit, a file's path (one the worker confined, read and
    checked) travels instead: reading a file again costs the main process less than receiving its bytes through
    the worker's pipe (unpickled while holding the interpreter lock)."""

    data: bytearray | str | SlotBytes | np.ndarray
    width: int
    height: int

    def read(self) -> bytearray | np.ndarray:
        """The JPEG's bytes (a file is read into a buffer of its own: nvjpeg's input tensor views it)."""
        if not isinstance(self.data, str):
            return self.data
        with open(self.data, "rb") as fh:
            data = bytearray(os.fstat(fh.fileno()).st_size)
            if fh.readinto(data) != len(data):
                raise OSError(f"{self.data} changed size while it was read")
            return data


def device_decodable(data: bytes) -> tuple[int, int] | None:
    """The (width, height) of a JPEG the GPU decodes as the CPU would, else None: three-channel (not greyscale,
    CMYK or YCCK), upright (no EXIF orientation but 1) and whole (it ends with the end-of-image marker; a truncated
    file goes the CPU's way, which reports it). Reads the headers only."""
    if data[-2:] != b"\xff\xd9":
        return None
    try:
        with Image.open(io.BytesIO(data)) as image:
            upright = image.format == "JPEG" and image.mode == "RGB" and image.getexif().get(0x0112, 1) == 1
            return image.size if upright else None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        return None


# PIL's resample filters the device geometry computes (``resize_weights``): each one's half-width in input samples
# at scale 1 (bilinear's triangle, bicubic's cubic with a = -0.5)
AA_HALF_WIDTH = {2: 1.0, 3: 2.0}


def _aa_filter(x: torch.Tensor, resample: int) -> torch.Tensor:
    """PIL's (and torch's antialiased) filter ``resample`` at distances ``x`` >= 0."""
    if resample == 2:
        return (1.0 - x).clamp_(min=0.0)
    return torch.where(x < 1.0, (1.5 * x - 2.5) * x * x + 1.0,
                       torch.where(x < 2.0, ((-0.5 * x + 2.5) * x - 4.0) * x + 2.0, 0.0))


def resize_weights(sizes: torch.Tensor, length: int, size: int, taps: int, resample: int) -> torch.Tensor:
    """float32 [B, length, size]: for each row ``(n_in, n_out, start)`` of the int64 [B, 3] ``sizes``, row ``o``
    holds the weights over the input samples of output ``start + o`` of an antialiased resize of ``n_in`` samples
    to ``n_out`` with PIL's filter ``resample``, zero from ``n_in`` on: PIL's and torch's rule (``interpolate(...,
    antialias=True)``: a window of ``taps`` at most around each output's centre, the filter stretched by the
    downscale, normalised to sum 1), in float64 for all images at once, then float32."""
    n_in, n_out, start = sizes.double().unbind(-1)
    scale = (n_in / n_out)[:, None]
    support = AA_HALF_WIDTH[resample] * scale.clamp(min=1.0)
    invscale = torch.where(scale >= 1.0, 1.0 / scale, 1.0)
    center = scale * (start[:, None] + torch.arange(length, dtype=torch.float64, device=sizes.device) + 0.5)
    first = (center - support + 0.5).trunc_().clamp_(min=0.0)  # the window, as C's int casts truncate
    end = torch.minimum((center + support + 0.5).trunc_(), n_in[:, None])
    at = first[..., None] + torch.arange(taps, dtype=torch.float64, device=sizes.device)  # [B, length, taps]
    weights = _aa_filter(((at - center[..., None] + 0.5) * invscale[..., None]).abs_(), resample)
    weights = weights * (at < end[..., None])
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros((sizes.shape[0], length, size), dtype=torch.float32, device=sizes.device)
    # taps past the window weigh 0: clamped into the matrix, they add nothing wherever they land
    return out.scatter_add_(2, at.long().clamp_(max=size - 1), weights.float())


class ClipDeviceGeometry:
    """``ClipGeometry`` (``cpu``) with the JPEG decode and the resize moved to the encoder's GPU, for prepare on
    CUDA; ``ClipGeometry.on_device`` offers it.

    Why: on a GPU host, prepare's worker processes decoding + resizing on the CPU (milliseconds a COCO-sized JPEG
    each) bound the run, while nvjpeg decodes several times as many images a second on the GPU.

    The worker half (``__call__``) hands over a ``JpegItem`` for a JPEG the GPU decodes as the CPU would
    (``device_decodable``) and runs ``ClipGeometry`` on anything else (other formats, greyscale, rotated or
    truncated JPEGs). ``device_batch`` finishes a batch on the device: nvjpeg decodes the JPEGs at full size
    (torchvision's ``decode_jpeg``), and each image's shortest-edge resize + centre crop is one product
    ``R_h @ x @ R_w^T``, whose matrices are the antialiased filter's weights (PIL's and torch's,
    ``resize_weights``) restricted to the cropped rows and columns, so images of different sizes resize together
    in two batched GEMMs. Pixels differ from the CPU's by nvjpeg's IDCT and colour conversion and by float rounding
    against PIL's fixed point (mean under one level on COCO-like photos), so the identity differs
    from the CPU geometry's. Only the bilinear and bicubic filters (``AA_HALF_WIDTH``) are computed here."""

    stacks = False  # items are JpegItems or tensors: each travels as it is, nothing is stacked in the worker
    slot_bytes_per_item = 256 * 1024  # a chunk's slot holds its JPEGs' bytes (``hand_over``) up to this on average
    DEVICE_CHUNK = 256  # images decoded and resized at once, at most
    PIXEL_BUDGET = 256 * 640 * 640  # padded pixels a chunk resizes (float32, 3 channels: 1.2 GiB)

    def __init__(self, cpu: Any, decoder_version: str | None = None) -> None:
        if cpu.resample not in AA_HALF_WIDTH:
            raise ValueError(f"the device geometry resizes with PIL's bilinear (2) or bicubic (3) filter, not "
                             f"resample={cpu.resample}: keep this processor's decode on the CPU")
        self.cpu = cpu
        # nvjpeg comes with torchvision's build: another build may decode other pixels
        # /2: the resize weights in closed form, float64 rounded to float32 (/1: torch's float32 resize of an
        # identity matrix); pixels can differ from /1's by a level where a product sits at a rounding tie
        self.identity = f"clip-nvjpeg/2 torchvision {decoder_version or importlib.metadata.version('torchvision')}"
        self._checked = False  # check_decoder has decoded on the device
        self._decoding: ThreadPoolExecutor | None = None  # device_batch's decode thread, made at its first call

    def __call__(self, value: Any) -> JpegItem | torch.Tensor:
        data = media_bytes(value)
        is_jpeg = isinstance(data, bytes | bytearray) and data[:3] == b"\xff\xd8\xff"
        size = device_decodable(data) if is_jpeg else None
        if size is not None:
            source = unwrap(value)  # a path when the value had no bytes of its own: the path travels
            return JpegItem(str(source) if isinstance(source, str | Path) else bytearray(data), *size)
        return self.cpu(data)  # the bytes already read: the file is not opened twice

    def hand_over(self, items: list[Any], put: Callable[[Any], SlotBytes | None]) -> list[Any]:
        """In a worker, a row's items as they travel: each JPEG's bytes (a file's read straight into the slot)
        ``put`` into the chunk's shared slot where they fit, so the main process reads them there instead of
        opening the file again (tens of microseconds an image, on the decode thread) or unpickling them."""
        out = []
        for item in items:
            if isinstance(item, JpegItem) and isinstance(item.data, str | bytes | bytearray):
                at = put(item.data)
                item = item if at is None else item._replace(data=at)
            out.append(item)
        return out

    def take_over(self, items: list[Any], view: Callable[[SlotBytes], np.ndarray]) -> list[Any]:
        """In the main process, the items ``hand_over`` sent, each JPEG put into the slot now viewing its bytes
        there."""
        return [item._replace(data=view(item.data)) if isinstance(item, JpegItem) and isinstance(item.data, SlotBytes)
                else item for item in items]

    def decode_jpegs(self, datas: list[bytearray | np.ndarray], device: torch.device) -> list[torch.Tensor]:
        """uint8 [3, h, w] images on ``device``, decoded by nvjpeg in one batched call."""
        from torchvision.io import ImageReadMode, decode_jpeg  # optional: torchvision (decode: device)

        return decode_jpeg([torch.frombuffer(d, dtype=torch.uint8) for d in datas], mode=ImageReadMode.RGB,
                           device=device)

    def resize_crop(self, images: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """uint8 [B, 3, crop_h, crop_w] of uint8 [3, h, w] images of any sizes: ``ClipGeometry``'s resize and
        crop (without its DCT-scaled decode) as a batched product, in float32 without TF32, rounded. The host
        work is a few calls a chunk, not an image: the zero-padded float batch is one nested tensor's
        ``to_padded_tensor``, and every image's row and column weights come from one closed-form computation on
        the device (``resize_weights``) fed by one small copy of the images' sizes."""
        height, width = max(i.shape[1] for i in images), max(i.shape[2] for i in images)
        x = torch.nested.as_nested_tensor(images, dtype=torch.float32).to_padded_tensor(
            0.0, (len(images), 3, height, width))
        ch, cw = self.cpu.crop
        sizes, ratio_h, ratio_w = [], 1.0, 1.0
        for image in images:
            h, w = image.shape[1], image.shape[2]
            (out_w, out_h), top, left = self.cpu.placement(w, h)
            sizes.append((h, out_h, top, w, out_w, left))
            ratio_h, ratio_w = max(ratio_h, h / out_h), max(ratio_w, w / out_w)
        at = torch.tensor(sizes, dtype=torch.int64)
        at = at.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else at.to(device)
        half = AA_HALF_WIDTH[self.cpu.resample]
        # [B, ch, H] and [B, cw, W], zero beyond each image's own size
        rows = resize_weights(at[:, 0:3], ch, height, 2 * math.ceil(half * ratio_h) + 1, self.cpu.resample)
        cols = resize_weights(at[:, 3:6], cw, width, 2 * math.ceil(half * ratio_w) + 1, self.cpu.resample)
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False  # TF32 would move pixels by up to a level
        try:
            out = rows[:, None] @ (x @ cols[:, None].transpose(-1, -2))
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        return out.round_().clamp_(0, 255).to(torch.uint8)

    def chunks(self, items: list[Any], jpegs: list[int]) -> list[list[int]]:
        """``jpegs`` (indices of ``items``) by size, in runs of at most ``DEVICE_CHUNK`` whose padded size stays
        within ``PIXEL_BUDGET`` (an image larger than that alone): similar sizes pad little."""
        out: list[list[int]] = []
        height = width = 0
        for i in sorted(jpegs, key=lambda i: (items[i].height * items[i].width, i)):
            h, w = max(height, items[i].height), max(width, items[i].width)
            if out and len(out[-1]) < self.DEVICE_CHUNK and (len(out[-1]) + 1) * h * w <= self.PIXEL_BUDGET:
                out[-1].append(i)
                height, width = h, w
            else:
                out.append([i])
                height, width = items[i].height, items[i].width
        return out

    def decode_chunk(self, items: list[Any], at: list[int], device: torch.device,
                     stream: torch.cuda.Stream | None = None) -> list[torch.Tensor]:
        """The JPEGs ``at`` read and decoded in one nvjpeg call, with ``stream`` (the caller's) as the current one:
        ``device_batch`` runs this on its decode thread, and the images must be ready on the stream that
        resizes them."""
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            return self.decode_jpegs([items[i].read() for i in at], device)

    def finish(self, items: list[Any], at: list[int], device: torch.device,
               decoded: Future | None = None) -> torch.Tensor:
        """The JPEGs ``at`` decoded in one nvjpeg call (``decoded``: that call, already under way on the decode
        thread) and resized; if nvjpeg refuses the batch, each alone, and one it refuses alone goes through the CPU
        geometry (as a worker would have run it)."""
        try:
            images = decoded.result() if decoded is not None else self.decode_chunk(items, at, device)
            return self.resize_crop(images, device)
        except RuntimeError:
            if len(at) > 1:
                return torch.cat([self.finish(items, [i], device) for i in at])
            data = items[at[0]].read()  # PIL takes bytes or a path, not a view of a worker's slot: a copy
            return self.cpu(data if isinstance(data, bytes | bytearray) else bytes(data))[None].to(device)

    def check_decoder(self, device: torch.device) -> list[torch.Tensor]:
        """Decode one small JPEG on ``device`` once: a torchvision without a working nvjpeg fails here, with what
        to do, instead of sending every image through the CPU fallback of ``finish`` under this identity. The
        decoded image (none once checked)."""
        if self._checked:
            return []

        buf = io.BytesIO()
        Image.new("RGB", (64, 48), (200, 30, 90)).save(buf, "JPEG")
        try:
            decoded = self.decode_jpegs([bytearray(buf.getvalue())], device)
        except Exception as exc:  # noqa: BLE001 - whatever torchvision raises, the remedy is the same
            raise RuntimeError(f"nvjpeg cannot decode a JPEG on {device} ({type(exc).__name__}: {exc}); set "
                               f"data.prepare.decode: cpu") from exc
        self._checked = True
        return decoded

    def warm_up(self, device: str | torch.device) -> None:
        """nvjpeg's decoder and the float GEMMs of the resize set up on ``device``. prepare runs this in a thread
        of its own beside the encoder's loader, so the set-up (most of a second) overlaps both the encoder's
        load and the first shard's decoding, and leaves the encode thread."""
        device = torch.device(device)
        decoded = self.check_decoder(device)
        if decoded:
            self.resize_crop(decoded, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    def device_batch(self, items: list[Any], device: str | torch.device) -> torch.Tensor:
        """The uint8 [B, 3, crop_h, crop_w] batch on ``device`` of the worker half's items, in order: JPEGs
        decoded and resized there (``chunks``), the CPU geometry's tensors copied. Each chunk's files are read and
        decoded on a thread of the geometry's own while this one resizes the chunk before: nvjpeg's call lets the
        interpreter lock go while it decodes, and the resize's host work runs meanwhile."""
        device = torch.device(device)
        self.check_decoder(device)
        out = torch.empty((len(items), 3, *self.cpu.crop), dtype=torch.uint8, device=device)
        jpegs = [i for i, item in enumerate(items) if isinstance(item, JpegItem)]
        tensors = [i for i, item in enumerate(items) if not isinstance(item, JpegItem)]
        if tensors:
            out[tensors] = torch.stack([items[i] for i in tensors]).to(device, non_blocking=True)
        chunks = self.chunks(items, jpegs)
        if not chunks:
            return out
        if self._decoding is None:
            self._decoding = ThreadPoolExecutor(1, thread_name_prefix="stitch-jpeg-decode")
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        pending = self._decoding.submit(self.decode_chunk, items, chunks[0], device, stream)
        for k, at in enumerate(chunks):
            decoded = pending
            if k + 1 < len(chunks):
                pending = self._decoding.submit(self.decode_chunk, items, chunks[k + 1], device, stream)
            out[at] = self.finish(items, at, device, decoded)
        return out

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_decoding": None}  # a thread does not travel to a worker process
