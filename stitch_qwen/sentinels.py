"""The Qwen3.5 sentinel set: Qwen's own vision boundary tokens."""

from __future__ import annotations

from stitch.api import SentinelSpec

SENTINELS = SentinelSpec(
    name="qwen3.5",
    start="<|vision_start|>",
    placeholder="<|vision_pad|>",
    end="<|vision_end|>",
    # a clip's own brackets (the placeholder is shared): family control tokens the chat template never emits
    video_start="<|quad_start|>",
    video_end="<|quad_end|>",
    description="Qwen's own vision boundary tokens (<|vision_start|> 248053, <|vision_end|> 248054 in the published "
    "config; <|vision_pad|> is a family token the config does not name, docs/models.md). Qwen's native image and "
    "video processors use the distinct <|image_pad|>/<|video_pad|> payload tokens, so stitch's soft tokens "
    "(external route 'clip_image') never pass for a native Qwen image.",
)
