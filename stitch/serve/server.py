"""`stitch serve`: an OpenAI-compatible HTTP endpoint over one loaded checkpoint.

``GET /v1/models`` lists the served model; ``POST /v1/chat/completions`` takes OpenAI chat messages whose user
turn holds text parts and one ``image_url`` part (a base64 ``data:`` URL). The model stays loaded: each request
runs the recipe's encoder once on the image, projects it, and generates from prompt embeddings with the
checkpoint's engine, exactly as ``stitch infer`` does. A malformed request gets a 4xx JSON error in OpenAI's
shape and the server keeps serving.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from stitch.plugins.registry import Registry
from stitch.serve.inference import Stitched

MAX_REQUEST_BYTES = 32 * 2**20
MAX_IMAGE_PIXELS = 40_000_000


class RequestError(Exception):
    """A client error: HTTP status, OpenAI error type and a message naming the field at fault."""

    def __init__(self, status: HTTPStatus, message: str, kind: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status.phrase.lower().replace(" ", "_")}}


def decode_data_url(url: Any, max_pixels: int = MAX_IMAGE_PIXELS) -> bytes:
    """The image bytes of a ``data:image/...;base64,`` URL; refuses other URLs, bad base64, non-images and images
    over ``max_pixels``."""
    field = "messages[].content[].image_url.url"
    if not isinstance(url, str) or not url.startswith("data:"):
        raise RequestError(HTTPStatus.BAD_REQUEST, f"{field}: expected a base64 data URL "
                           f"(data:image/png;base64,...), got {str(url)[:40]!r}; remote URLs are not fetched",
                           param=field)
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise RequestError(HTTPStatus.BAD_REQUEST, f"{field}: expected ';base64' data, got header {header!r}",
                           param=field)
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(HTTPStatus.BAD_REQUEST, f"{field}: invalid base64 ({exc})", param=field) from exc

    try:
        with Image.open(io.BytesIO(raw)) as image:  # reads the header only: size before any decode
            width, height = image.size
    except (UnidentifiedImageError, OSError) as exc:
        raise RequestError(HTTPStatus.BAD_REQUEST, f"{field}: not a readable image ({exc})", param=field) from exc
    if width * height > max_pixels:
        raise RequestError(HTTPStatus.BAD_REQUEST, f"{field}: image is {width}x{height} = {width * height:,} "
                           f"pixels; this server accepts at most {max_pixels:,}", param=field)
    return raw


def parse_chat_request(body: dict[str, Any], model_name: str, max_pixels: int = MAX_IMAGE_PIXELS
                       ) -> tuple[bytes, str, int]:
    """(image bytes, question text, max new tokens) from an OpenAI chat-completions request body."""
    if not isinstance(body, dict):
        raise RequestError(HTTPStatus.BAD_REQUEST, f"request body: expected a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model != model_name:
        raise RequestError(HTTPStatus.NOT_FOUND, f"model {model!r} does not exist; this server serves "
                           f"{model_name!r} (GET /v1/models)", kind="invalid_request_error", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(HTTPStatus.BAD_REQUEST, "messages: expected a non-empty list", param="messages")
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise RequestError(HTTPStatus.BAD_REQUEST, "messages: no user message", param="messages")
    content = users[-1].get("content")
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(parts, list):
        raise RequestError(HTTPStatus.BAD_REQUEST, "messages[-1].content: expected a string or a list of parts",
                           param="messages")
    texts, images = [], []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            texts.append(str(part.get("text", "")))
        elif kind == "image_url":
            url = part.get("image_url")
            images.append(url.get("url") if isinstance(url, dict) else url)
        else:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"messages[-1].content: unsupported part {kind!r}; "
                               f"expected 'text' or 'image_url'", param="messages")
    if len(images) != 1:
        raise RequestError(HTTPStatus.BAD_REQUEST, f"messages[-1].content: expected exactly one image_url part, "
                           f"got {len(images)}", param="messages")
    question = "\n".join(t for t in texts if t).strip()
    if not question:
        raise RequestError(HTTPStatus.BAD_REQUEST, "messages[-1].content: no text question", param="messages")
    limit = body.get("max_completion_tokens", body.get("max_tokens", 64))
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 4096:
        raise RequestError(HTTPStatus.BAD_REQUEST, f"max_tokens: expected an integer in [1, 4096], got {limit!r}",
                           param="max_tokens")
    return decode_data_url(images[0], max_pixels), question, limit


class ChatServer(ThreadingHTTPServer):
    """Holds the loaded model; requests are answered one generation at a time."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], stitched: Any, model_name: str,
                 max_pixels: int = MAX_IMAGE_PIXELS, max_request_bytes: int = MAX_REQUEST_BYTES) -> None:
        super().__init__(address, ChatHandler)
        self.stitched, self.model_name = stitched, model_name
        self.max_pixels, self.max_request_bytes = max_pixels, max_request_bytes
        self.lock = threading.Lock()
        self.created = int(time.time())

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        image, question, limit = parse_chat_request(body, self.model_name, self.max_pixels)
        with self.lock:
            try:
                text = self.stitched.answer(image, question, max_new_tokens=limit)
            except ValueError as exc:  # the encoder refused the item
                raise RequestError(HTTPStatus.BAD_REQUEST, f"image: {exc}", param="messages") from exc
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        }


class ChatHandler(BaseHTTPRequestHandler):
    server: ChatServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def _send(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path.rstrip("/") == "/v1/models":
            self._send(HTTPStatus.OK, {"object": "list", "data": [
                {"id": self.server.model_name, "object": "model", "created": self.server.created,
                 "owned_by": "stitch"}]})
        elif self.path.rstrip("/") == "/health":
            self._send(HTTPStatus.OK, {"status": "ok"})
        else:
            self._send(HTTPStatus.NOT_FOUND, RequestError(HTTPStatus.NOT_FOUND, f"no route {self.path}").body())

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        try:
            if self.path.rstrip("/") != "/v1/chat/completions":
                raise RequestError(HTTPStatus.NOT_FOUND, f"no route {self.path}")
            length = int(self.headers.get("Content-Length") or 0)
            if length > self.server.max_request_bytes:
                self.close_connection = True  # the body is not read: do not reuse this connection
                raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"request body is {length:,} bytes; "
                                   f"this server accepts at most {self.server.max_request_bytes:,}")
            try:
                body = json.loads(self.rfile.read(length) or b"null")
            except json.JSONDecodeError as exc:
                raise RequestError(HTTPStatus.BAD_REQUEST, f"request body is not JSON ({exc})") from exc
            self._send(HTTPStatus.OK, self.server.complete(body))
        except RequestError as exc:
            self._send(exc.status, exc.body())
        except Exception as exc:  # noqa: BLE001 - a server bug must not take the server down
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": {"message": f"{type(exc).__name__}: {exc}",
                                                                    "type": "server_error", "param": None,
                                                                    "code": "internal_server_error"}})


def serve(checkpoint: Path, registry: Registry, host: str = "127.0.0.1", port: int = 8000,
          engine: str = "embedded", model_name: str | None = None, max_pixels: int = MAX_IMAGE_PIXELS,
          ready: Any = None) -> None:
    """Load ``checkpoint`` once (its model, encoder and engine looked up in ``registry``) and serve it until
    interrupted; ``ready(server)`` is called once listening."""
    stitched = Stitched(Path(checkpoint), registry, engine=engine)
    name = model_name or stitched.model_spec.name
    server = ChatServer((host, port), stitched, name, max_pixels=max_pixels)
    if ready is not None:
        ready(server)
    try:
        server.serve_forever()
    finally:
        server.server_close()
