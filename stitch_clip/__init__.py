"""stitch-clip: the CLIP ViT-B/32 image encoder (49 patch tokens x 768), its tiny random-init stand-ins, their payloads."""

from __future__ import annotations

from stitch.api import feature_payload_spec, hookimpl
from stitch_clip.encoder import (
    CLIP_B32,
    CLIP_DEMO,
    CLIP_TINY,
    DEMO_FEATURE_WIDTH,
    DEMO_PAYLOAD,
    FEATURE_WIDTH,
    PAYLOAD,
    TOKENS_PER_ITEM,
)

__all__ = ["register_encoders", "register_rollout_payloads"]


@hookimpl
def register_encoders(register):
    register(CLIP_B32)
    register(CLIP_TINY)
    register(CLIP_DEMO)


@hookimpl
def register_rollout_payloads(register):
    register(feature_payload_spec(PAYLOAD, "image", TOKENS_PER_ITEM, FEATURE_WIDTH))
    register(feature_payload_spec(DEMO_PAYLOAD, "image", TOKENS_PER_ITEM, DEMO_FEATURE_WIDTH))
