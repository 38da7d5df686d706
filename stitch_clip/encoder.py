"""CLIP vision encoding: image decoding, CLIP's own preprocessing, penultimate-layer patch features."""

from __future__ import annotations

import contextlib
import io
import math
import os
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from stitch.api import EncoderSpec, ModelSource, SlotBytes

FEATURE_WIDTH = 768
TOKENS_PER_ITEM = 49  # (224 / 32) ** 2 patches; the CLS token is dropped
SELECT_LAYER = -2  # LLaVA's choice: the penultimate layer's patch tokens
CLIP_REPO = "openai/clip-vit-base-patch32"
CLIP_REVISION = "3d74acf9a28c67741b2f4f2ea7635f0aaf6f0268"
PAYLOAD = "clip_image"  # the rollout payload ViT-B/32-wide features travel in (registered in __init__)
# The CPU demo's tower: ViT-B/32's grid (49 patch tokens of 32 px) at a third of its width, so preparing
# thousands of rows takes seconds on two cores and their cache stays small (49 x 256 x 2 bytes = 24.5 KiB).
DEMO_FEATURE_WIDTH = 256
DEMO_PAYLOAD = "clip_image_demo"
# ClipDeviceGeometry.resize_crop pads a chunk of images through a (strided) nested tensor, whose use torch marks as a
# prototype with a warning on every first use; the one call it makes is stable since torch 1.13
warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype stage", category=UserWarning)


def _unwrap(value: Any) -> Any:
    """A ``{"bytes", "path"}`` dict (datasets' Image) as its bytes, or its path when it has none; else ``value``."""
    if isinstance(value, dict):  # bytes win; the path is only opened when there are none
        found = value["bytes"] if value.get("bytes") is not None else value.get("path")
        if not found:
            raise ValueError("image dict has neither 'bytes' nor 'path'")
        return found
    return value


def _open_image(value: Any) -> Any:
    """A lazily opened PIL image from bytes, a ``{"bytes", "path"}`` dict (datasets' Image) or a path."""
    from PIL import Image

    value = _unwrap(value)
    if isinstance(value, bytes | bytearray):
        return Image.open(io.BytesIO(value))
    if isinstance(value, str | Path):
        return Image.open(value)
    raise ValueError(f"expected an image, bytes or a path, got {type(value).__name__}")


def decode_image(value: Any, min_short_side: int | None = None) -> Any:
    """A PIL RGB image from a PIL image, bytes, a ``{"bytes", "path"}`` dict (datasets' Image) or a path.

    ``min_short_side``: a JPEG may decode at a reduced DCT scale (1/2, 1/4, 1/8: PIL's ``draft``), the smallest
    that still leaves its short side at least this long; the caller then resizes down to it anyway."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    try:
        image = _open_image(value)
        if min_short_side is not None and image.format == "JPEG":
            # PIL picks scale = min(w // s, h // s) in {8, 4, 2, 1}: both sides stay >= s
            image.draft("RGB", (min_short_side, min_short_side))
        image.load()
        # a camera's EXIF orientation says how to turn the stored pixels upright; CLIP must see them upright
        return ImageOps.exif_transpose(image).convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"cannot decode image: {exc}") from exc


def drop_unused_layers(model: Any, select_layer: int = SELECT_LAYER) -> Any:
    """Cut the tower after the layer whose output is used: with ``select_layer`` -2 the last layer's work is
    thrown away, so it is never run. The truncated tower's ``last_hidden_state`` (CLIP applies its
    ``post_layernorm`` to the pooled CLS token only) equals the full tower's ``hidden_states[select_layer]``."""
    tower = getattr(model, "vision_model", model)  # older transformers nest the tower one level down
    layers = tower.encoder.layers
    keep = len(layers) + select_layer + 1
    if not 0 < keep <= len(layers):
        raise ValueError(f"select layer {select_layer} does not exist in a {len(layers)}-layer tower")
    tower.encoder.layers = layers[:keep]
    model.config.num_hidden_layers = keep
    return model


class PatchGemm(torch.nn.Conv2d):
    """CLIP's patch embedding (a Conv2d whose kernel equals its stride, no padding) computed as what it is: one
    GEMM of the [patches, channels x kernel] unfolded pixels with the [width, channels x kernel] weight.

    Why: on the H200 cuDNN ran ViT-B/32's 32 x 32 / stride-32 conv as ``precomputed_convolve_sgemm``, 16.7 ms of
    a 72.5 ms encode of 2,048 images (BENCHMARKS.md §0d), for 0.5 TFLOP that a tensor-core GEMM does in about a
    millisecond. Same weights and state-dict keys (the class is switched in place); any input whose size the
    kernel does not tile runs the stock conv."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        kh, kw = self.kernel_size
        if h % kh or w % kw:
            return super().forward(x)
        gh, gw = h // kh, w // kw
        patches = x.reshape(b, c, gh, kh, gw, kw).permute(0, 2, 4, 1, 3, 5).reshape(b * gh * gw, c * kh * kw)
        out = torch.nn.functional.linear(patches, self.weight.reshape(self.out_channels, -1), self.bias)
        return out.reshape(b, gh, gw, -1).permute(0, 3, 1, 2)  # [B, width, gh, gw], as the conv returns


def patch_embedding_as_gemm(model: Any) -> bool:
    """Switch the tower's patch embedding to ``PatchGemm`` where it is a non-overlapping conv; True when done."""
    tower = getattr(model, "vision_model", model)
    conv = getattr(getattr(tower, "embeddings", None), "patch_embedding", None)
    if (type(conv) is not torch.nn.Conv2d or conv.kernel_size != conv.stride or conv.padding != (0, 0)
            or conv.dilation != (1, 1) or conv.groups != 1):
        return False
    conv.__class__ = PatchGemm
    return True


class ClipPixels:
    """CLIP's preprocessing for a batch: images already at the crop size skip the resize and crop (both are the
    identity there) and go straight to one vectorised rescale + normalise; any other size goes through the
    snapshot's own ``CLIPImageProcessor``. Same pixel values as the processor, a fraction of its time."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        crop = processor.crop_size
        self.size = (crop["width"], crop["height"])
        self.scale = float(processor.rescale_factor)
        self.mean = torch.tensor(processor.image_mean, dtype=torch.float32).view(1, 3, 1, 1)
        self.std = torch.tensor(processor.image_std, dtype=torch.float32).view(1, 3, 1, 1)
        self.fast = bool(processor.do_rescale and processor.do_normalize)

    def __call__(self, items: list[Any]) -> torch.Tensor:
        if not self.fast or any(getattr(item, "size", None) != self.size for item in items):
            return self.processor(images=items, return_tensors="pt")["pixel_values"]
        arrays = np.stack([np.asarray(item.convert("RGB"), dtype=np.uint8) for item in items])
        pixels = torch.from_numpy(arrays).permute(0, 3, 1, 2).to(torch.float32)
        return (pixels * self.scale - self.mean) / self.std


# PIL resample filters that torch's uint8 resize computes as PIL does (antialiased; bicubic with PIL's a = -0.5)
TORCH_RESAMPLE = {2: "bilinear", 3: "bicubic"}


def resize_uint8(pixels: torch.Tensor, size: tuple[int, int], resample: int) -> torch.Tensor:
    """A ``uint8 [3, H, W]`` image resized to ``size`` ``(width, height)`` with PIL's filter ``resample``, on torch's
    uint8 kernels (the vectorised ones of torchvision's antialiased resize): the same filter as PIL's, about 4x faster
    on one core, and within one uint8 level of PIL's pixels (measured: a level's difference in about 0.5 % of them,
    the fixed-point rounding). A filter torch does not compute as PIL does goes through PIL."""
    mode = TORCH_RESAMPLE.get(resample)
    if mode is None:
        from PIL import Image

        image = Image.fromarray(pixels.permute(1, 2, 0).numpy()).resize(size, resample=resample)
        return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)
    out = torch.nn.functional.interpolate(pixels[None], size=(size[1], size[0]), mode=mode, antialias=True)
    return out[0]


class ClipGeometry:
    """CLIPImageProcessor's geometry on uint8, for prepare's worker processes: decode (a JPEG at the smallest DCT
    scale that keeps its short side >= ``shortest_edge``), resize of the short side to ``shortest_edge`` with the
    processor's filter (long side ``int(edge * long / short)``, the processor's rule; ``resize_uint8``), centre crop;
    a ``uint8 [3, H, W]`` tensor. Rescale and normalisation happen on the encoder's device (``ClipImageEncoder.encode``
    of a uint8 batch)."""

    identity = "clip-uint8-draft/2"  # /2: torch's uint8 resize (within a level of /1's PIL resize)

    item_dtype = torch.uint8

    def __init__(self, shortest_edge: int, crop: tuple[int, int], resample: int) -> None:
        self.shortest_edge, self.crop, self.resample = shortest_edge, crop, resample  # crop: (height, width)

    @property
    def item_shape(self) -> tuple[int, int, int]:
        """The shape of every tensor this returns (prepare sizes its shared slots by it)."""
        return (3, *self.crop)

    def placement(self, w: int, h: int) -> tuple[tuple[int, int], int, int]:
        """For a ``w`` x ``h`` image: the ``(width, height)`` its short side resizes to (the processor's rule,
        long side ``int(edge * long / short)``), and the top and left of the centre crop in that resized image."""
        edge, (ch, cw) = self.shortest_edge, self.crop
        out_w, out_h = (edge, int(edge * h / w)) if w <= h else (int(edge * w / h), edge)
        return (out_w, out_h), (out_h - ch) // 2, (out_w - cw) // 2

    def __call__(self, value: Any) -> torch.Tensor:
        image = decode_image(value, min_short_side=self.shortest_edge)
        size, top, left = self.placement(*image.size)
        pixels = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)  # channels-last strides: the fast kernel
        if size != image.size:
            pixels = resize_uint8(pixels, size, self.resample)
        ch, cw = self.crop
        return pixels[:, top : top + ch, left : left + cw].contiguous()

    def on_device(self, device: str | torch.device) -> ClipGeometry | ClipDeviceGeometry:
        """The preprocessing for an encoder on ``device``: on a CUDA device with torchvision installed, JPEGs
        decode there (``ClipDeviceGeometry``) where the processor's filter is bilinear or bicubic; anywhere else,
        this one."""
        import importlib.util

        on_cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
        # the device resizes with the filters resize_weights computes; any other stays with the workers' PIL
        if on_cuda and self.resample in AA_HALF_WIDTH and importlib.util.find_spec("torchvision") is not None:
            return ClipDeviceGeometry(self)
        return self


def _media_bytes(value: Any) -> Any:
    """``value`` (bytes, a ``{"bytes", "path"}`` dict or a path) as bytes, the file read once; anything else as
    it is (``ClipGeometry`` reports what it cannot decode)."""
    value = _unwrap(value)
    if isinstance(value, str | Path):
        with open(value, "rb") as fh:
            return fh.read()
    return value


class JpegItem(NamedTuple):
    """A JPEG handed from a worker to the device: its bytes, or the path of the file holding them, and its size
    from the headers (to chunk by pixels). Between processes its bytes travel in the chunk's shared slot
    (``ClipDeviceGeometry.hand_over``: ``data`` is then a ``SlotBytes`` in the worker and a uint8 view of the
    slot in the main process), or, where they do not fit, a file's path (one the worker confined, read and
    checked) travels instead: reading a 65 KB file again took less of the main process than receiving its bytes
    through the worker's pipe (1 GB for 16k photos, unpickled while holding the interpreter lock)."""

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
    from PIL import Image, UnidentifiedImageError

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
    """``ClipGeometry`` with the JPEG decode and the resize moved to the encoder's GPU, for prepare on CUDA.

    Why: prepare's worker processes were the bound on the H200 host, decoding + resizing at ~3.2 ms a
    COCO-sized JPEG each (15 of them: ~3,600 images/s), while nvjpeg there decodes ~22,000 a second.

    The worker half (``__call__``) hands over a ``JpegItem`` for a JPEG the GPU decodes as the CPU would
    (``device_decodable``) and runs ``ClipGeometry`` on anything else (other formats, greyscale, rotated or
    truncated JPEGs). ``device_batch`` finishes a batch on the device: nvjpeg decodes the JPEGs at full size
    (torchvision's ``decode_jpeg``), and each image's shortest-edge resize + centre crop is one product
    ``R_h @ x @ R_w^T``, whose matrices are the antialiased filter's weights (PIL's and torch's,
    ``resize_weights``) restricted to the cropped rows and columns, so images of different sizes resize together
    in two batched GEMMs. Pixels differ from the CPU's by nvjpeg's IDCT and colour conversion and by float rounding
    against PIL's fixed point (mean under one level on COCO-like photos, BENCHMARKS.md), so the identity differs
    from the CPU geometry's. Only the bilinear and bicubic filters (``AA_HALF_WIDTH``) are computed here."""

    stacks = False  # items are JpegItems or tensors: each travels as it is, nothing is stacked in the worker
    slot_bytes_per_item = 256 * 1024  # a chunk's slot holds its JPEGs' bytes (``hand_over``) up to this on average
    DEVICE_CHUNK = 256  # images decoded and resized at once, at most
    PIXEL_BUDGET = 256 * 640 * 640  # padded pixels a chunk resizes (float32, 3 channels: 1.2 GiB)

    def __init__(self, cpu: ClipGeometry, decoder_version: str | None = None) -> None:
        from importlib.metadata import version

        if cpu.resample not in AA_HALF_WIDTH:
            raise ValueError(f"the device geometry resizes with PIL's bilinear (2) or bicubic (3) filter, not "
                             f"resample={cpu.resample}: keep this processor's decode on the CPU")
        self.cpu = cpu
        # nvjpeg comes with torchvision's build: another build may decode other pixels
        # /2: the resize weights in closed form, float64 rounded to float32 (/1: torch's float32 resize of an
        # identity matrix); pixels can differ from /1's by a level where a product sits at a rounding tie
        self.identity = f"clip-nvjpeg/2 torchvision {decoder_version or version('torchvision')}"
        self._checked = False  # check_decoder has decoded on the device
        self._decoding: ThreadPoolExecutor | None = None  # device_batch's decode thread, made at its first call

    def __call__(self, value: Any) -> JpegItem | torch.Tensor:
        data = _media_bytes(value)
        is_jpeg = isinstance(data, bytes | bytearray) and data[:3] == b"\xff\xd8\xff"
        size = device_decodable(data) if is_jpeg else None
        if size is not None:
            source = _unwrap(value)  # a path when the value had no bytes of its own: the path travels
            return JpegItem(str(source) if isinstance(source, str | Path) else bytearray(data), *size)
        return self.cpu(data)  # the bytes already read: the file is not opened twice

    def hand_over(self, items: list[Any], put: Callable[[Any], SlotBytes | None]) -> list[Any]:
        """In a worker, a row's items as they travel: each JPEG's bytes (a file's read straight into the slot)
        ``put`` into the chunk's shared slot where they fit, so the main process reads them there instead of
        opening the file again (41-54 us an image on the H200's hosts, on the decode thread) or unpickling them."""
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
        from torchvision.io import ImageReadMode, decode_jpeg

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
        from PIL import Image

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
        of its own beside the encoder's loader, so the set-up (~0.85 s on the H200) overlaps both the encoder's
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


def clip_geometry(processor: Any) -> ClipGeometry | None:
    """The processor's preprocessing as a ``ClipGeometry``, or None where it is not the shortest-edge resize +
    centre crop + rescale + normalise of CLIP (then prepare decodes in workers and the processor runs as before)."""
    size, crop = dict(processor.size or {}), dict(processor.crop_size or {})
    edge = size.get("shortest_edge")
    standard = (
        processor.do_resize and processor.do_center_crop and processor.do_rescale and processor.do_normalize
        and getattr(processor, "do_convert_rgb", True) in (True, None)
        and set(k for k, v in size.items() if v is not None) == {"shortest_edge"} and edge
        and crop.get("height") and crop.get("width") and crop["height"] <= edge and crop["width"] <= edge
    )
    if not standard:
        return None
    return ClipGeometry(int(edge), (int(crop["height"]), int(crop["width"])), int(processor.resample))


def load_clip_preprocess(source: ModelSource) -> ClipGeometry | None:
    """The snapshot's preprocessing for prepare's workers; reads only its processor config, never the weights."""
    from transformers import CLIPImageProcessor

    return clip_geometry(CLIPImageProcessor.from_pretrained(**source.pretrained_kwargs()))


class ClipImageEncoder:
    """Frozen CLIPVisionModel + CLIPImageProcessor; ``encode`` returns [B, 49, width] (768 for ViT-B/32).

    ``encode`` takes decoded images (the processor runs) or a uint8 batch [B, 3, H, W] that ``ClipGeometry``
    made: that is copied to the device as uint8 (a quarter of float32's bytes) and rescaled + normalised there.
    A host uint8 batch goes to a GPU on a side stream, in chunks of ``pipeline_chunk``: each copy is queued while
    the tower encodes the chunk before it, or, for a batch of one chunk, the batch of the call before (on one
    stream the copies and the tower took turns; 1,024 images are 154 MB of uint8)."""

    pipeline_chunk: int | None = 1024  # images per copied chunk; None: one copy on the tower's stream, then the tower

    def __init__(self, model: Any, processor: Any, device: torch.device, dtype: torch.dtype,
                 feature_width: int = FEATURE_WIDTH) -> None:
        model = drop_unused_layers(model)
        patch_embedding_as_gemm(model)
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.processor = processor
        self.pixels = ClipPixels(processor)
        self.device = device
        self.dtype = dtype
        self.feature_width = feature_width
        self.scale = self.pixels.scale
        self.mean, self.std = self.pixels.mean.to(device), self.pixels.std.to(device)
        self._tower = self._patches
        self.compiled_batch: int | None = None
        self._copy_stream: Any = None

    def _patches(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 pixels on the device (normalised here: inside a compiled tower the rescale, normalisation, cast
        and the patch embedding's unfold are one kernel, not five) or normalised ones -> patch features."""
        if pixels.dtype == torch.uint8:
            pixels = self.normalise(pixels)
        # contiguous: compiled, the last residual add writes the patch rows directly; eager, one copy
        return self.model(pixel_values=pixels).last_hidden_state[:, 1:, :].contiguous()

    @property
    def fused_mlps(self) -> int:
        """MLPs whose fc1 + bias + quick-GELU ``compile`` made one GEMM (``stitch_clip.gemm``)."""
        from stitch_clip.gemm import fused_count

        return fused_count(self.model)

    def compile(self, batch_size: int) -> None:
        """``torch.compile`` the tower for batches of ``batch_size``, or of ``pipeline_chunk`` when that is smaller
        (the chunks a large batch is copied and encoded in); smaller ones are padded to it: one graph, no
        recompiles at shard or partition ends.

        First, on a Hopper GPU with quack installed, each MLP's fc1 + bias + quick-GELU becomes one GEMM
        (``stitch_clip.gemm``: 1.10-1.12x the compiled encode on the H200). It goes with compiling because its
        start-up (importing the DSL and building the kernel, ~4 s on the H200) pays only where compiling does:
        prepare compiles for large jobs (``data.prepare.compile``), serving encodes one image at a time."""
        from stitch_clip.gemm import fuse_where_it_runs

        fuse_where_it_runs(self.model, self.device, self.dtype)
        self._tower = torch.compile(self._patches, dynamic=False)
        self.compiled_batch = min(batch_size, self.pipeline_chunk or batch_size)

    def warm_up(self, batch_size: int) -> None:
        """Encode one batch of black images of the crop size: the device's context, library handles and the
        kernels of a ``batch_size`` batch are set up before the first real batch (prepare does this while its
        workers decode the first shard). Nothing to set up on the CPU."""
        if self.device.type != "cuda":
            return
        crop = dict(getattr(self.processor, "crop_size", None) or {})
        height, width = crop.get("height", 224), crop.get("width", 224)
        self.encode(torch.zeros((batch_size, 3, height, width), dtype=torch.uint8))
        torch.cuda.synchronize(self.device)

    def normalise(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 [B, 3, H, W] -> the tower's input on its device: ``(x * rescale - mean) / std`` in float32 (the
        processor's arithmetic), then the tower's dtype."""
        x = pixels.to(self.device, non_blocking=True).to(torch.float32)
        return ((x * self.scale - self.mean) / self.std).to(self.dtype)

    @torch.no_grad()  # not inference_mode: its tensors could not flow into a trainable projector
    def encode(self, items: list[Any] | torch.Tensor) -> torch.Tensor:
        if isinstance(items, torch.Tensor) and items.dtype == torch.uint8:
            if self.pipeline_chunk is None or self.device.type != "cuda" or items.is_cuda or not len(items):
                patches = self._run(items.to(self.device, non_blocking=True))
            else:
                chunks = items.split(self.compiled_batch or self.pipeline_chunk)
                # several chunks write into one output; a single chunk's features are the output
                out = None if len(chunks) == 1 else torch.empty(
                    (len(items), TOKENS_PER_ITEM, self.feature_width), dtype=self.dtype, device=self.device)
                at = 0
                for on_device in self._copied_ahead(chunks):
                    features = self._run(on_device, None if out is None else out[at : at + len(on_device)])
                    at += len(on_device)
                patches = features if out is None else out
        else:
            patches = self._run(self.pixels(items).to(self.device, self.dtype))
        if tuple(patches.shape[1:]) != (TOKENS_PER_ITEM, self.feature_width):
            raise ValueError(
                f"CLIP snapshot produced features {tuple(patches.shape[1:])}; this encoder declares "
                f"({TOKENS_PER_ITEM}, {self.feature_width}): use a ViT-B/32-shaped tower at 224 px"
            )
        return patches

    def _copied_ahead(self, chunks: tuple[torch.Tensor, ...]) -> Iterator[torch.Tensor]:
        """Each host chunk on the encoder's GPU, in order: the next chunk's copy is queued on a side stream before
        this one is handed over, so it runs while the caller encodes this one; the compute stream waits for a
        chunk's copy before using it, and the allocator keeps the chunk until that use is done."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        side, compute = self._copy_stream, torch.cuda.current_stream(self.device)

        def copy(chunk: torch.Tensor) -> torch.Tensor:
            with torch.cuda.stream(side):
                return chunk.to(self.device, non_blocking=True)

        ahead = copy(chunks[0])
        for index in range(len(chunks)):
            compute.wait_stream(side)  # this chunk's copy (the only one queued so far) has landed
            current = ahead
            current.record_stream(compute)
            if index + 1 < len(chunks):
                ahead = copy(chunks[index + 1])
            yield current

    def _run(self, pixels: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tower's patch features of ``pixels`` (uint8 or already normalised, on the device), written into
        ``out`` when given (each chunk's features land in place: no concatenation afterwards)."""
        step = self.compiled_batch
        if step is None or not len(pixels):  # the tower as it is, on the whole batch
            features = self._tower(pixels)
            return features if out is None else out.copy_(features)
        for start in range(0, pixels.shape[0], step):
            chunk = pixels[start : start + step]
            n = chunk.shape[0]
            if n < step:  # pad: every sample is computed independently, the padding rows are dropped
                chunk = torch.cat([chunk, chunk.new_zeros((step - n, *chunk.shape[1:]))])
            features = self._tower(chunk)[:n]
            if out is None and n == pixels.shape[0]:
                return features
            if out is None:
                out = features.new_empty((pixels.shape[0], *features.shape[1:]))
            out[start : start + n] = features
        assert out is not None
        return out


def load_clip(source: ModelSource, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
              feature_width: int = FEATURE_WIDTH):
    from transformers import CLIPImageProcessor, CLIPVisionModel

    from stitch_clip.attention import register

    kwargs = source.pretrained_kwargs()
    # stitch_vit: a Triton kernel for the tower's 50-token rows on a GPU in half precision, transformers' sdpa
    # elsewhere; both give eager attention's features (tests/test_prepare_fast.py, tests/test_vit_attention.py)
    model = CLIPVisionModel.from_pretrained(**kwargs, use_safetensors=True, attn_implementation=register())
    processor = CLIPImageProcessor.from_pretrained(**kwargs)
    return ClipImageEncoder(model, processor, torch.device(device), dtype, feature_width)


def load_demo_clip(source: ModelSource, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    return load_clip(source, device, dtype, DEMO_FEATURE_WIDTH)


def build_tiny_clip(out_dir: Path, width: int = FEATURE_WIDTH) -> None:
    """A random-init CLIPVisionModel snapshot (2 layers) with ViT-B/32's 49-token grid, ``width`` wide."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    config = CLIPVisionConfig(
        hidden_size=width,
        intermediate_size=1024 if width == FEATURE_WIDTH else 2 * width,
        num_hidden_layers=2,
        num_attention_heads=12 if width == FEATURE_WIDTH else width // 64,
        image_size=224,
        patch_size=32,
        projection_dim=512,
    )
    CLIPVisionModel(config).save_pretrained(out_dir, safe_serialization=True)
    # CLIP's own preprocessing: shortest edge 224, center crop, CLIP mean/std
    CLIPImageProcessor(
        size={"shortest_edge": 224},
        crop_size={"height": 224, "width": 224},
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    ).save_pretrained(out_dir)


CLIP_B32 = EncoderSpec(
    name="clip-vit-base-patch32",
    modality="image",
    feature_width=FEATURE_WIDTH,
    tokens_per_item=TOKENS_PER_ITEM,
    source=ModelSource(repo_id=CLIP_REPO, revision=CLIP_REVISION),
    load=load_clip,
    decode_item=decode_image,
    load_preprocess=load_clip_preprocess,
    payload=PAYLOAD,
    description="OpenAI CLIP ViT-B/32 vision tower, penultimate-layer patch tokens",
)

CLIP_TINY = EncoderSpec(
    name="clip-tiny",
    modality="image",
    feature_width=FEATURE_WIDTH,
    tokens_per_item=TOKENS_PER_ITEM,
    source=ModelSource(builder=build_tiny_clip, builder_key="clip-tiny-v1"),
    load=load_clip,
    decode_item=decode_image,
    load_preprocess=load_clip_preprocess,
    payload=PAYLOAD,
    description="random-init 2-layer CLIPVisionModel with ViT-B/32's 49 x 768 contract (tests)",
)


def build_demo_clip(out_dir: Path) -> None:
    build_tiny_clip(out_dir, DEMO_FEATURE_WIDTH)


CLIP_DEMO = EncoderSpec(
    name="clip-demo",
    modality="image",
    feature_width=DEMO_FEATURE_WIDTH,
    tokens_per_item=TOKENS_PER_ITEM,
    source=ModelSource(builder=build_demo_clip, builder_key="clip-demo-v1"),
    load=load_demo_clip,
    decode_item=decode_image,
    load_preprocess=load_clip_preprocess,
    payload=DEMO_PAYLOAD,
    description="random-init 2-layer CLIPVisionModel on ViT-B/32's 49-patch grid, 256 wide (the CPU demo)",
)
