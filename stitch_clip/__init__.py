"""stitch-clip: the CLIP ViT-B/32 image encoder (49 patch tokens x 768), its tiny random-init stand-ins, their video
routes (frames sampled from a clip, each encoded once; ``stitch-clip[video]``), their payloads."""

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
from stitch_clip.video import FrameSampling, clip_video_encoder

# Shipped video routes: ViT-B/32 on 8 frames spread over the clip, pooled in pairs (4 x 49 tokens); the tiny towers
# on 4 frames pooled in pairs (2 x 49). Other sampling: register clip_video_encoder(CLIP_B32, ...) in a plugin.
CLIP_B32_VIDEO = clip_video_encoder(CLIP_B32, "clip-vit-base-patch32-video", FrameSampling(frames=8, pool=2),
                                    "clip_video")
CLIP_TINY_VIDEO = clip_video_encoder(CLIP_TINY, "clip-tiny-video", FrameSampling(frames=4, pool=2),
                                     "clip_video_tiny")
CLIP_DEMO_VIDEO = clip_video_encoder(CLIP_DEMO, "clip-demo-video", FrameSampling(frames=4, pool=2),
                                     "clip_video_demo")
VIDEO_ENCODERS = (CLIP_B32_VIDEO, CLIP_TINY_VIDEO, CLIP_DEMO_VIDEO)

__all__ = ["register_encoders", "register_rollout_payloads"]


@hookimpl
def register_encoders(register):
    register(CLIP_B32)
    register(CLIP_TINY)
    register(CLIP_DEMO)
    for spec in VIDEO_ENCODERS:
        register(spec)


@hookimpl
def register_rollout_payloads(register):
    register(feature_payload_spec(PAYLOAD, "image", TOKENS_PER_ITEM, FEATURE_WIDTH))
    register(feature_payload_spec(DEMO_PAYLOAD, "image", TOKENS_PER_ITEM, DEMO_FEATURE_WIDTH))
    for spec in VIDEO_ENCODERS:
        register(feature_payload_spec(spec.payload, "video", spec.tokens_per_item, spec.feature_width))
