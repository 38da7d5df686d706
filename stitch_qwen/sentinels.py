"""The Qwen3.5 sentinel set: Qwen's own vision boundary tokens."""

from __future__ import annotations

from stitch.api import SentinelSpec

SENTINELS = SentinelSpec(
    name="qwen3.5",
    start="<|vision_start|>",
    placeholder="<|vision_pad|>",
    end="<|vision_end|>",
    description="Qwen's own vision boundary tokens, single tokens in the real tokenizer. Qwen's native image and "
    "video processors use the distinct <|image_pad|>/<|video_pad|> payload tokens, so stitch's soft tokens "
    "(external route 'clip_image') never pass for a native Qwen image.",
)
