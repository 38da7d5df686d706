"""CLIP vision encoding: image decoding, CLIP's own preprocessing, penultimate-layer patch features."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from stitch.api import EncoderSpec, ModelSource

FEATURE_WIDTH = 768
TOKENS_PER_ITEM = 49  # (224 / 32) ** 2 patches; the CLS token is dropped
SELECT_LAYER = -2  # LLaVA's choice: the penultimate layer's patch tokens
CLIP_REPO = "openai/clip-vit-base-patch32"
CLIP_REVISION = "3d74acf9a28c67741b2f4f2ea7635f0aaf6f0268"
PAYLOAD = "clip_image"  # the rollout payload both CLIP encoders' features travel in (registered in __init__)


def decode_image(value: Any) -> Any:
    """A PIL RGB image from a PIL image, bytes, a ``{"bytes", "path"}`` dict (datasets' Image) or a path."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    try:
        if isinstance(value, dict):
            if value.get("bytes") is not None:
                value = value["bytes"]
            elif value.get("path"):
                value = value["path"]
            else:
                raise ValueError("image dict has neither 'bytes' nor 'path'")
        if isinstance(value, bytes | bytearray):
            image = Image.open(io.BytesIO(value))
        elif isinstance(value, str | Path):
            image = Image.open(value)
        else:
            raise ValueError(f"expected an image, bytes or a path, got {type(value).__name__}")
        image.load()
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"cannot decode image: {exc}") from exc


class ClipImageEncoder:
    """Frozen CLIPVisionModel + CLIPImageProcessor; ``encode`` returns [B, 49, 768]."""

    def __init__(self, model: Any, processor: Any, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.processor = processor
        self.device = device
        self.dtype = dtype

    @torch.no_grad()  # not inference_mode: its tensors could not flow into a trainable projector
    def encode(self, items: list[Any]) -> torch.Tensor:
        pixels = self.processor(images=items, return_tensors="pt")["pixel_values"]
        out = self.model(pixel_values=pixels.to(self.device, self.dtype), output_hidden_states=True)
        patches = out.hidden_states[SELECT_LAYER][:, 1:, :]
        if tuple(patches.shape[1:]) != (TOKENS_PER_ITEM, FEATURE_WIDTH):
            raise ValueError(
                f"CLIP snapshot produced features {tuple(patches.shape[1:])}; this encoder declares "
                f"({TOKENS_PER_ITEM}, {FEATURE_WIDTH}): use a ViT-B/32 at 224 px"
            )
        return patches


def load_clip(source: ModelSource, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    from transformers import CLIPImageProcessor, CLIPVisionModel

    kwargs = source.pretrained_kwargs()
    model = CLIPVisionModel.from_pretrained(**kwargs, use_safetensors=True)
    processor = CLIPImageProcessor.from_pretrained(**kwargs)
    return ClipImageEncoder(model, processor, torch.device(device), dtype)


def build_tiny_clip(out_dir: Path) -> None:
    """A random-init CLIPVisionModel snapshot (2 layers) with ViT-B/32's 49 x 768 output contract."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    config = CLIPVisionConfig(
        hidden_size=FEATURE_WIDTH,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=12,
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
    payload=PAYLOAD,
    description="random-init 2-layer CLIPVisionModel with ViT-B/32's 49 x 768 contract (tests, demo)",
)
