"""CLIP vision encoding: PIL image decoding, CLIP's own preprocessing, the tower's penultimate-layer patch features.
The GPU paths (nvjpeg decode + slot hand-over, the patch GEMM, copies ahead, compile) live in ``stitch_clip.nvjpeg``
and ``stitch_clip.fast``."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from stitch.api import EncoderSpec, ModelSource
from stitch_clip.attention import register
from stitch_clip.fast import CopyAhead, compile_tower, patch_embedding_as_gemm
from stitch_clip.gemm import fused_count
from stitch_clip.media import unwrap
from stitch_clip.nvjpeg import AA_HALF_WIDTH, ClipDeviceGeometry

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


def _open_image(value: Any) -> Any:
    """A lazily opened PIL image from bytes, a ``{"bytes", "path"}`` dict (datasets' Image) or a path."""
    value = unwrap(value)
    if isinstance(value, bytes | bytearray):
        return Image.open(io.BytesIO(value))
    if isinstance(value, str | Path):
        return Image.open(value)
    raise ValueError(f"expected an image, bytes or a path, got {type(value).__name__}")


def decode_image(value: Any, min_short_side: int | None = None) -> Any:
    """A PIL RGB image from a PIL image, bytes, a ``{"bytes", "path"}`` dict (datasets' Image) or a path.

    ``min_short_side``: a JPEG may decode at a reduced DCT scale (1/2, 1/4, 1/8: PIL's ``draft``), the smallest
    that still leaves its short side at least this long; the caller then resizes down to it anyway."""
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
    on one core, and within one uint8 level of PIL's pixels (a level's difference in about 0.5 % of them, the
    fixed-point rounding). A filter torch does not compute as PIL does goes through PIL."""
    mode = TORCH_RESAMPLE.get(resample)
    if mode is None:
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
        on_cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
        # the device resizes with the filters resize_weights computes; any other stays with the workers' PIL
        if on_cuda and self.resample in AA_HALF_WIDTH and importlib.util.find_spec("torchvision") is not None:
            return ClipDeviceGeometry(self)
        return self


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


def clip_processor_class() -> type:
    """``CLIPImageProcessor`` as transformers resolves it: its PIL backend when torchvision is missing. Named
    directly, because reading ``transformers.CLIPImageProcessor`` without torchvision prints a fallback warning."""
    import transformers  # deferred: plugin loading skips transformers

    if importlib.util.find_spec("torchvision") is None:
        return transformers.CLIPImageProcessorPil
    return transformers.CLIPImageProcessor


def load_clip_preprocess(source: ModelSource) -> ClipGeometry | None:
    """The snapshot's preprocessing for prepare's workers; reads only its processor config, never the weights."""
    return clip_geometry(clip_processor_class().from_pretrained(**source.pretrained_kwargs()))


class ClipImageEncoder:
    """Frozen CLIPVisionModel + CLIPImageProcessor; ``encode`` returns [B, 49, width] (768 for ViT-B/32).

    ``encode`` takes decoded images (the processor runs) or a uint8 batch [B, 3, H, W] that ``ClipGeometry``
    made: that is copied to the device as uint8 (a quarter of float32's bytes) and rescaled + normalised there.
    A host uint8 batch goes to a GPU on a side stream, in chunks of ``pipeline_chunk``: each copy is queued while
    the tower encodes the chunk before it, or, for a batch of one chunk, the batch of the call before (on one
    stream the copies and the tower take turns; 1,024 images are 154 MB of uint8)."""

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
        self._copied_ahead = CopyAhead(device)

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
        return fused_count(self.model)

    def compile(self, batch_size: int) -> None:
        """``torch.compile`` the tower for batches of ``batch_size``, or of ``pipeline_chunk`` when that is smaller
        (the chunks a large batch is copied and encoded in); smaller ones are padded to it: one graph, no
        recompiles at shard or partition ends.

        First, on a Hopper GPU with quack installed, each MLP's fc1 + bias + quick-GELU becomes one GEMM
        (``stitch_clip.gemm``, faster than the compiled pair). It goes with compiling because its start-up
        (importing the DSL and building the kernel, seconds) pays only where compiling does: prepare compiles for
        large jobs (``data.prepare.compile``), serving encodes one image at a time."""
        self._tower = compile_tower(self._patches, self.model, self.device, self.dtype)
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
    from transformers import CLIPVisionModel  # deferred: plugin loading skips transformers

    kwargs = source.pretrained_kwargs()
    # stitch_vit: a Triton kernel for the tower's 50-token rows on a GPU in half precision, transformers' sdpa
    # elsewhere; both give eager attention's features (tests/data/test_prepare_fast.py,
    # tests/first_party/test_vit_attention.py)
    model = CLIPVisionModel.from_pretrained(**kwargs, use_safetensors=True, attn_implementation=register())
    processor = clip_processor_class().from_pretrained(**kwargs)
    return ClipImageEncoder(model, processor, torch.device(device), dtype, feature_width)


def load_demo_clip(source: ModelSource, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    return load_clip(source, device, dtype, DEMO_FEATURE_WIDTH)


def build_tiny_clip(out_dir: Path, width: int = FEATURE_WIDTH) -> None:
    """A random-init CLIPVisionModel snapshot (2 layers) with ViT-B/32's 49-token grid, ``width`` wide."""
    from transformers import CLIPVisionConfig, CLIPVisionModel  # deferred: plugin loading skips transformers

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
    clip_processor_class()(
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
    content_parts=("image_url",),
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
    content_parts=("image_url",),
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
    content_parts=("image_url",),
    description="random-init 2-layer CLIPVisionModel on ViT-B/32's 49-patch grid, 256 wide (the CPU demo)",
)
