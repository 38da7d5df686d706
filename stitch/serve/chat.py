"""OpenAI chat-completions requests as `stitch serve` reads them: every field checked before any heavy work, media
parts routed by what the served encoder declares (``EncoderSpec.content_parts``), errors in OpenAI's JSON shape."""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from PIL import Image, UnidentifiedImageError

from stitch.plugins.specs import EncoderSpec
from stitch.rollout.prompts import MEDIA, MediaSlot
from stitch.serve.batching import Sampling

ROLES = ("system", "developer", "user", "assistant")


class RequestError(Exception):
    """A client error: HTTP status, OpenAI error type and a message naming the field at fault."""

    def __init__(self, status: HTTPStatus, message: str, kind: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status.phrase.lower().replace(" ", "_")}}


def bad(message: str, param: str | None = None) -> RequestError:
    return RequestError(HTTPStatus.BAD_REQUEST, message, param=param)


@dataclass(frozen=True)
class MediaPart:
    kind: str  # the content-part type: image_url, input_audio, video_url or a plugin's
    data: bytes
    field: str  # where it stood, e.g. messages[2].content[1]


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]  # role + content (str, or a list of text pieces and MEDIA slots)
    media: list[MediaPart]  # in the order of the MEDIA slots
    sampling: Sampling
    stream: bool
    include_usage: bool


@dataclass(frozen=True)
class Limits:
    max_tokens: int = 4096
    max_n: int = 16
    max_media: int = 16
    max_image_pixels: int = 40_000_000


def part_bytes(kind: str, value: Any, field: str) -> bytes:
    """The raw bytes a media part carries: a base64 ``data:`` URL (a string or ``{"url": ...}``), or
    ``{"data": base64}`` (``input_audio``'s shape). Remote URLs are not fetched."""
    if isinstance(value, dict):
        value = value.get("url", value.get("data"))
    if not isinstance(value, str):
        raise bad(f"{field}.{kind}: expected a base64 data URL or {{'data': base64}}, got {type(value).__name__}",
                  field)
    if value.startswith("data:"):
        header, _, value = value.partition(",")
        if not header.endswith(";base64"):
            raise bad(f"{field}.{kind}: expected ';base64' data, got header {header[:60]!r}", field)
    elif "://" in value[:16]:
        raise bad(f"{field}.{kind}: remote URLs are not fetched; send the bytes as a base64 data URL", field)
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise bad(f"{field}.{kind}: invalid base64 ({exc})", field) from exc


def check_image(data: bytes, field: str, max_pixels: int) -> None:
    """Refuse what is not an image, or one over ``max_pixels``, from its header alone (nothing is decoded)."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
    except Image.DecompressionBombError as exc:
        raise bad(f"{field}.image_url: image is over the {max_pixels:,} pixels this server accepts ({exc})",
                  field) from exc
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise bad(f"{field}.image_url: not a readable image ({exc})", field) from exc
    if width * height > max_pixels:
        raise bad(f"{field}.image_url: image is {width}x{height} = {width * height:,} pixels; this server accepts "
                  f"at most {max_pixels:,}", field)


def route_parts(encoder: EncoderSpec, registered: Sequence[EncoderSpec]) -> tuple[frozenset[str], dict[str, str]]:
    """(part types the served encoder takes, {part type: encoder name} of the other registered encoders' parts):
    a part another modality declares is refused naming the encoder that would take it."""
    others = {kind: spec.name for spec in registered if spec.name != encoder.name for kind in spec.content_parts}
    return frozenset(encoder.content_parts), others


def _content(message: dict[str, Any], at: str, accepted: frozenset[str], others: dict[str, str],
             encoder: str) -> tuple[str | list[str | MediaSlot], list[MediaPart]]:
    content = message.get("content")
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise bad(f"{at}.content: expected a string or a list of content parts, got {type(content).__name__}", at)
    pieces: list[str | MediaSlot] = []
    media: list[MediaPart] = []
    for j, part in enumerate(content):
        field = f"{at}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            pieces.append(part["text"])
        elif kind in accepted:
            if message.get("role") != "user":
                raise bad(f"{field}: {kind} parts belong in user messages, not {message.get('role')!r}", field)
            media.append(MediaPart(kind, part_bytes(kind, part.get(kind), field), field))
            pieces.append(MEDIA)
        elif kind in others:
            raise bad(f"{field}: this model's encoder {encoder!r} takes {sorted(accepted)} parts; {kind!r} is "
                      f"taken by encoder {others[kind]!r}, which this checkpoint was not trained with", field)
        else:
            raise bad(f"{field}: unsupported content part {kind!r}; expected 'text' or one of {sorted(accepted)}",
                      field)
    return pieces, media


def _messages(body: dict[str, Any], accepted: frozenset[str], others: dict[str, str], encoder: str,
              limits: Limits) -> tuple[list[dict[str, Any]], list[MediaPart]]:
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages: expected a non-empty list", "messages")
    messages, media = [], []
    for i, message in enumerate(raw):
        at = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise bad(f"{at}.role: expected one of {list(ROLES)}, got {role!r}", at)
        content, parts = _content(message, at, accepted, others, encoder)
        messages.append({"role": "system" if role == "developer" else role, "content": content})
        media += parts
    if messages[-1]["role"] != "user":
        raise bad(f"messages[{len(messages) - 1}]: the last message must be the user's, got "
                  f"{messages[-1]['role']!r}", "messages")
    if len(media) > limits.max_media:
        raise bad(f"messages: {len(media)} media parts; this server accepts at most {limits.max_media}", "messages")
    for part in media:
        if part.kind == "image_url":
            check_image(part.data, part.field, limits.max_image_pixels)
    return messages, media


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise bad(f"{name}: expected a number in [{low}, {high}], got {value!r}", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise bad(f"{name}: expected an integer in [{low}, {high}], got {value!r}", name)
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and 0 < len(s) <= 256 for s in stop):
        raise bad(f"stop: expected a string or up to 4 non-empty strings, got {body.get('stop')!r}", "stop")
    return tuple(stop)


def sampling_of(body: dict[str, Any], limits: Limits) -> Sampling:
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _integer({"max_tokens": limit}, "max_tokens", min(256, limits.max_tokens), 1, limits.max_tokens)
    return Sampling(max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                    top_p=_number(body, "top_p", 1.0, 1e-6, 1.0), n=_integer(body, "n", 1, 1, limits.max_n),
                    seed=_integer(body, "seed", None, -(2**63), 2**63 - 1), stop=_stop(body))


def parse_chat_request(body: Any, model_name: str, encoder: EncoderSpec, registered: Sequence[EncoderSpec],
                       limits: Limits) -> ChatRequest:
    """A checked ``ChatRequest`` from a chat-completions body, or a ``RequestError`` naming the field at fault."""
    if not isinstance(body, dict):
        raise bad(f"request body: expected a JSON object, got {type(body).__name__}")
    if body.get("model") != model_name:
        raise RequestError(HTTPStatus.NOT_FOUND, f"model {body.get('model')!r} does not exist; this server serves "
                           f"{model_name!r} (GET /v1/models)", param="model")
    accepted, others = route_parts(encoder, registered)
    messages, media = _messages(body, accepted, others, encoder.name, limits)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad(f"stream: expected true or false, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    return ChatRequest(messages, media, sampling_of(body, limits), stream, include_usage)
