"""Video through CLIP: a clip decoded with PyAV (the ``stitch-clip[video]`` extra), frames sampled at a fixed count
or rate, each frame encoded once by a CLIP image tower, consecutive frames optionally pooled into one group of
patch tokens. A clip is one media item of ``groups x 49`` tokens, bracketed by the family's video sentinels."""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stitch.api import EncoderSpec, ModelSource
from stitch_clip.media import unwrap

VIDEO_EXTRA = "stitch-clip[video]"


class VideoError(ValueError):
    """A clip that cannot be used; ``kind`` names the reason (prepare groups skipped rows by it)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def require_av() -> Any:
    """PyAV, or one clear refusal naming the extra that installs it."""
    try:
        import av  # deferred: the video extra is optional
    except ImportError as exc:
        raise VideoError("no-video-decoder", f"decoding video needs PyAV, which is not installed: "
                                             f"pip install '{VIDEO_EXTRA}'") from exc
    return av


@dataclass(frozen=True)
class FrameSampling:
    """Which frames of a clip are kept: ``frames`` of them, spread evenly over the whole clip (each the frame on
    screen at the middle of its equal share), or, with ``fps``, one every ``1/fps`` seconds from the start (a clip
    shorter than that window is refused). ``pool`` consecutive kept frames are averaged into one group of patch
    tokens (the last group may hold fewer). Clips over ``max_seconds`` or with frames over ``max_pixels`` are
    refused from their header, before decoding."""

    frames: int
    fps: float | None = None
    pool: int = 1
    max_seconds: float = 600.0
    max_pixels: int = 3840 * 2160

    def __post_init__(self) -> None:
        if self.frames < 1 or self.pool < 1 or (self.fps is not None and self.fps <= 0):
            raise ValueError(f"FrameSampling needs frames >= 1, pool >= 1 and fps > 0 or None; got {self}")

    @property
    def groups(self) -> int:
        """Token groups a clip yields: ``ceil(frames / pool)``."""
        return math.ceil(self.frames / self.pool)

    @property
    def identity(self) -> str:
        rate = f"fps{self.fps:g}" if self.fps is not None else "even"
        return f"video/{self.frames}x{rate}/pool{self.pool}"

    def times(self, duration: float, where: str) -> list[float]:
        """The instants (seconds from the clip's start) whose frames are kept."""
        if self.fps is None:
            return [(i + 0.5) * duration / self.frames for i in range(self.frames)]
        window = (self.frames - 1) / self.fps
        if duration <= window:
            raise VideoError("video-too-short", f"{where}: lasts {duration:.3g} s; {self.frames} frames at "
                                                f"{self.fps:g} fps need more than {window:.3g} s")
        return [i / self.fps for i in range(self.frames)]


def _describe(value: Any) -> str:
    value = unwrap(value)
    return f"video {str(value)!r}" if isinstance(value, str | Path) else f"video of {len(value)} bytes"


def sample_frames(value: Any, sampling: FrameSampling) -> list[Any]:
    """The kept frames of a clip (bytes, a ``{"bytes", "path"}`` dict or a path) as PIL RGB images, in time order;
    raises ``VideoError`` naming the clip, what was expected and what it holds."""
    av = require_av()
    raw = unwrap(value)
    where = _describe(value)
    source = io.BytesIO(bytes(raw)) if isinstance(raw, bytes | bytearray | memoryview) else raw
    if not isinstance(source, io.BytesIO | str | Path):
        raise VideoError("media-type", f"expected video bytes or a path, got {type(raw).__name__}")
    try:
        container = av.open(source, "r")
    except (av.error.FFmpegError, OSError, ValueError) as exc:
        raise VideoError("corrupt-video", f"{where}: not a decodable video ({exc})") from exc
    with container:
        if not container.streams.video:
            raise VideoError("corrupt-video", f"{where}: holds no video stream (streams: "
                                              f"{[s.type for s in container.streams]})")
        stream = container.streams.video[0]
        pixels = (stream.codec_context.width or 0) * (stream.codec_context.height or 0)
        if pixels > sampling.max_pixels:
            raise VideoError("video-too-large", f"{where}: frames of {stream.codec_context.width}x"
                                                f"{stream.codec_context.height} = {pixels:,} pixels; at most "
                                                f"{sampling.max_pixels:,} are accepted")
        duration = _duration(container, stream)
        if duration is not None and duration > sampling.max_seconds:
            raise VideoError("video-too-long", f"{where}: lasts {duration:.1f} s; at most {sampling.max_seconds:g} s "
                                               f"are accepted")
        try:
            decoded = _decode_until(container, stream, sampling, duration, where)
        except av.error.FFmpegError as exc:
            raise VideoError("corrupt-video", f"{where}: decoding failed ({exc})") from exc
    return decoded


def _duration(container: Any, stream: Any) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1_000_000  # av.time_base: microseconds
    return None


def _decode_until(container: Any, stream: Any, sampling: FrameSampling, duration: float | None,
                  where: str) -> list[Any]:
    """Decode in order, keeping for each sampled instant the frame on screen then; stops after the last one. A
    clip without a declared duration is decoded whole first (still under ``max_seconds``)."""
    if duration is None:
        frames = [(float(f.time or 0.0), f.to_image()) for f in container.decode(stream)]
        if frames and frames[-1][0] > sampling.max_seconds:
            raise VideoError("video-too-long", f"{where}: runs past {sampling.max_seconds:g} s")
        last = frames[-1][0] + 1.0 / float(stream.average_rate or 25) if frames else 0.0
        return _pick(frames, sampling.times(last, where) if frames else [], where)
    times = sampling.times(duration, where)
    frames: list[tuple[float, Any]] = []
    for frame in container.decode(stream):
        at = float(frame.time or 0.0)
        if frames and at > times[-1]:
            break
        frames.append((at, frame.to_image()))
    return _pick(frames, times, where)


def _pick(frames: list[tuple[float, Any]], times: list[float], where: str) -> list[Any]:
    if not frames:
        raise VideoError("video-no-frames", f"{where}: decoded 0 frames; expected at least 1")
    out, k = [], 0
    for t in times:
        while k + 1 < len(frames) and frames[k + 1][0] <= t:
            k += 1
        out.append(frames[k][1])
    return out


def pool_frames(features: torch.Tensor, pool: int) -> torch.Tensor:
    """``[clips, frames, tokens, width]`` -> ``[clips, ceil(frames / pool) * tokens, width]``: each run of ``pool``
    consecutive frames averaged token by token (the last run may be shorter), the groups in time order."""
    clips, frames, tokens, width = features.shape
    groups = [features[:, g : g + pool].mean(dim=1) for g in range(0, frames, pool)]
    return torch.stack(groups, dim=1).reshape(clips, len(groups) * tokens, width)


class ClipFrames:
    """Prepare's and serving's preprocessing of one clip: the sampled frames through the CLIP image
    preprocessing ``frame`` (``ClipGeometry``), stacked as ``uint8 [frames, 3, H, W]``. Picklable (workers)."""

    item_dtype = torch.uint8

    def __init__(self, frame: Any, sampling: FrameSampling) -> None:
        self.frame, self.sampling = frame, sampling
        self.identity = f"{sampling.identity}+{frame.identity}"

    @property
    def item_shape(self) -> tuple[int, ...]:
        return (self.sampling.frames, *self.frame.item_shape)

    def __call__(self, value: Any) -> torch.Tensor:
        return torch.stack([self.frame(image) for image in sample_frames(value, self.sampling)])


class ClipVideoEncoder:
    """A CLIP image encoder run on every sampled frame once: ``encode`` takes ``uint8 [clips, frames, 3, H, W]``
    (``ClipFrames``) or lists of decoded frames, and returns ``[clips, groups x tokens, width]`` after temporal
    pooling. ``frames_encoded`` counts the frames the tower has seen."""

    def __init__(self, image: Any, sampling: FrameSampling) -> None:
        self.image, self.sampling = image, sampling
        self.frames_encoded = 0

    def encode(self, clips: torch.Tensor | list[list[Any]]) -> torch.Tensor:
        if isinstance(clips, torch.Tensor):
            count, frames = clips.shape[:2]
            features = self.image.encode(clips.reshape(count * frames, *clips.shape[2:]))
        else:
            count, frames = len(clips), self.sampling.frames
            features = self.image.encode([image for clip in clips for image in clip])
        self.frames_encoded += count * frames
        return pool_frames(features.reshape(count, frames, *features.shape[1:]), self.sampling.pool)

    def compile(self, batch_size: int) -> None:
        self.image.compile(batch_size * self.sampling.frames)

    def warm_up(self, batch_size: int) -> None:
        if callable(getattr(self.image, "warm_up", None)):
            self.image.warm_up(batch_size * self.sampling.frames)


def _load(load_image: Callable[..., Any], sampling: FrameSampling, source: ModelSource,
          device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> ClipVideoEncoder:
    return ClipVideoEncoder(load_image(source, device, dtype), sampling)


def _load_preprocess(load_frame: Callable[[ModelSource], Any], sampling: FrameSampling,
                     source: ModelSource) -> ClipFrames:
    require_av()  # refused once, before any row is read, when the extra is missing
    frame = load_frame(source)
    if frame is None:
        raise ValueError("the CLIP snapshot's processor is not the standard shortest-edge resize + centre crop; "
                         "its video route needs that geometry")
    return ClipFrames(frame, sampling)


def _decode(sampling: FrameSampling, value: Any) -> list[Any]:
    return sample_frames(value, sampling)


def clip_video_encoder(image: EncoderSpec, name: str, sampling: FrameSampling, payload: str,
                       description: str = "") -> EncoderSpec:
    """A video encoder over the CLIP image encoder ``image``: same source and width, ``sampling.groups x
    image.tokens_per_item`` tokens per clip, served from ``video_url`` parts. Register it with a payload of the
    same shape (``feature_payload_spec(payload, "video", tokens, width)``)."""
    assert image.load_preprocess is not None, f"{image.name} has no preprocessing to run on frames"
    return EncoderSpec(
        name=name,
        modality="video",
        feature_width=image.feature_width,
        tokens_per_item=sampling.groups * image.tokens_per_item,
        source=image.source,
        load=functools.partial(_load, image.load, sampling),
        decode_item=functools.partial(_decode, sampling),
        load_preprocess=functools.partial(_load_preprocess, image.load_preprocess, sampling),
        payload=payload,
        content_parts=("video_url",),
        description=description or f"{image.name} on {sampling.frames} frames per clip "
                                   f"({'evenly spread' if sampling.fps is None else f'at {sampling.fps:g} fps'}), "
                                   f"pooled by {sampling.pool}: {sampling.groups} x {image.tokens_per_item} tokens",
    )
