"""`stitch serve`: an OpenAI-compatible chat-completions endpoint over one loaded checkpoint, on Starlette (FastAPI)
and uvicorn, every request bounded before heavy work (docs/serving.md lists the limits and why this stack); generation
runs in one batching thread (``stitch.serve.batching``), so concurrent requests share decode steps."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from stitch.plugins.registry import Registry
from stitch.rollout.prompts import conversation_prompt_ids, payload_for, prompt_embeddings
from stitch.serve.batching import Batcher, Job
from stitch.serve.chat import ChatRequest, Limits, RequestError, bad, parse_chat_request
from stitch.serve.inference import Stitched


@dataclass(frozen=True)
class ServeLimits:
    """What one connection and one request may cost."""

    max_request_bytes: int = 32 * 2**20
    header_timeout_s: float = 10.0  # connect -> complete request headers; also an idle connection's life
    body_timeout_s: float = 30.0  # headers -> complete body
    request_timeout_s: float = 600.0  # a whole generation
    max_connections: int = 1024
    max_batch_rows: int = 32
    batch_wait_s: float = 0.0  # how long a batch's first request waits for others to join it
    chat: Limits = Limits()


class ServedModel:
    """A loaded checkpoint as the server uses it: requests become prompt embeddings (media encoded once each, the
    conversation rendered by ``conversation_prompt_ids``), decoded by the batcher."""

    def __init__(self, stitched: Stitched, model_name: str, limits: ServeLimits) -> None:
        self.stitched, self.model_name = stitched, model_name
        binding = stitched.binding
        self.encoder = binding.encoder_spec
        self.registered = [binding.registry.get("encoders", n) for n in binding.registry.names("encoders")]
        self.payload = payload_for(binding.registry, self.encoder)
        self.lock = threading.Lock()  # the encoder and the prompt embedding: one request at a time
        self.batcher = Batcher(stitched.model.lm, stitched.tokenizer, stitched.tokenizer.eos_token_id,
                               binding.pad_id, binding.suppress_ids, max_rows=limits.max_batch_rows,
                               wait_s=limits.batch_wait_s)

    def parse(self, body: Any, limits: Limits) -> ChatRequest:
        return parse_chat_request(body, self.model_name, self.encoder, self.registered, limits)

    @torch.no_grad()
    def embed(self, request: ChatRequest) -> tuple[torch.Tensor, int]:
        """(prompt embeddings ``[prompt_len, hidden]``, prompt tokens counting each soft token)."""
        binding = self.stitched.binding
        spec = self.encoder
        ids = conversation_prompt_ids(self.stitched.tokenizer, request.messages, binding.sentinel_ids,
                                      spec.tokens_per_item)
        with self.lock:
            features = []
            for part in request.media:
                try:
                    features.append(self.stitched.encode(part.data))
                except ValueError as exc:  # the encoder refused the item
                    raise bad(f"{part.field}.{part.kind}: {exc}", part.field) from exc
            stacked = (torch.cat(features) if features
                       else torch.zeros(0, spec.tokens_per_item, spec.feature_width))
            (embeds,) = prompt_embeddings(self.payload, self.stitched.model, [("request", ids, stacked)])
        return embeds, len(ids)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a header deadline: a connection that has not sent a whole request's
    headers ``header_timeout_s`` after it opened (or after its last response) is closed, so idle and slow-header
    clients cannot hold connections."""

    header_timeout_s = 10.0

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def _arm_header_deadline(self) -> None:
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._header_deadline_passed)

    def _header_deadline_passed(self) -> None:
        if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before and self.cycle is not None:
            self._header_deadline.cancel()  # headers complete: the body and the request have their own limits

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._header_deadline.cancel()
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._header_deadline.cancel()
        super().connection_lost(exc)


def error_response(error: RequestError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def read_body(receive: Callable[[], Awaitable[dict]], limits: ServeLimits) -> bytes:
    """The request body, refused with 413 once it passes the cap (nothing past it is kept) and 408 when it takes
    longer than ``body_timeout_s``."""
    chunks, size = [], 0
    deadline = time.monotonic() + limits.body_timeout_s
    while True:
        try:
            message = await asyncio.wait_for(receive(), timeout=max(deadline - time.monotonic(), 0.001))
        except TimeoutError:
            raise RequestError(HTTPStatus.REQUEST_TIMEOUT, f"the request body did not arrive within "
                               f"{limits.body_timeout_s:g} s") from None
        if message["type"] == "http.disconnect":
            raise RequestError(HTTPStatus.BAD_REQUEST, "the client disconnected while sending the body")
        size += len(message.get("body", b""))
        if size > limits.max_request_bytes:
            raise too_large(size, limits)
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def too_large(size: int, limits: ServeLimits) -> RequestError:
    return RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"request body is over {size:,} bytes; this server "
                        f"accepts at most {limits.max_request_bytes:,}")


def declared_length(request: Request, limits: ServeLimits) -> None:
    """Refuse a Content-Length that is not a non-negative integer, or over the cap, before reading anything."""
    value = request.headers.get("content-length")
    if value is None:
        return
    if not value.isdigit():
        raise bad(f"Content-Length: expected a non-negative integer, got {value[:40]!r}")
    if int(value) > limits.max_request_bytes:
        raise too_large(int(value), limits)


def parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise bad(f"request body is not UTF-8 ({exc})") from exc
    except RecursionError:
        raise bad("request body: JSON nested too deeply") from None
    except ValueError as exc:
        raise bad(f"request body is not JSON ({exc})") from exc


class Completion:
    """One request's choices as the batcher fills them, read from the event loop."""

    def __init__(self, n: int, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.events = loop, asyncio.Queue()
        self.texts, self.finish = [""] * n, [None] * n
        self.tokens = [0] * n

    def emit(self, index: int, text: str, finish: str | None) -> None:  # called in the batcher thread
        self.loop.call_soon_threadsafe(self.events.put_nowait, (index, text, finish))

    async def next(self, deadline: float) -> tuple[int, str, str | None]:
        index, text, finish = await asyncio.wait_for(self.events.get(), timeout=max(deadline - time.monotonic(), 0))
        self.texts[index] += text
        self.finish[index] = finish
        return index, text, finish

    def done(self) -> bool:
        return all(f is not None for f in self.finish)


def usage(prompt_tokens: int, job: Job) -> dict[str, int]:
    completion = sum(len(c.tokens) for c in job.choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def failed(finish: str | None) -> RequestError | None:
    if finish is not None and finish.startswith("error: "):
        return RequestError(HTTPStatus.INTERNAL_SERVER_ERROR, finish[7:], kind="server_error")
    return None


def create_app(served: ServedModel, limits: ServeLimits = ServeLimits()) -> FastAPI:
    app = FastAPI(title="stitch serve", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = HTTPStatus(exc.status_code)
        return error_response(RequestError(status, f"{request.method} {request.url.path}: {exc.detail}"))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        batcher = served.batcher
        return {"status": "ok", "model": served.model_name, "waiting": batcher.waiting.qsize(),
                "batches": batcher.batch_count, "recent_batch_rows": list(batcher.recent_rows)}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served.model_name, "object": "model", "created": created,
                                            "owned_by": "stitch"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        try:
            declared_length(request, limits)
            body = parse_json(await read_body(request.receive, limits))
            chat_request = served.parse(body, limits.chat)
            embeds, prompt_tokens = await asyncio.to_thread(served.embed, chat_request)
        except RequestError as exc:
            return error_response(exc)
        completion = Completion(chat_request.sampling.n, asyncio.get_running_loop())
        job = Job(embeds, chat_request.sampling, completion.emit)
        served.batcher.submit(job)
        deadline = time.monotonic() + limits.request_timeout_s
        if chat_request.stream:
            return StreamingResponse(stream(served.model_name, job, completion, deadline, prompt_tokens,
                                            chat_request.include_usage), media_type="text/event-stream")
        return await respond(served.model_name, job, completion, deadline, prompt_tokens)

    return app


async def respond(model: str, job: Job, completion: Completion, deadline: float, prompt_tokens: int) -> Response:
    try:
        while not completion.done():
            _, _, finish = await completion.next(deadline)
            if (error := failed(finish)) is not None:
                return error_response(error)
    except TimeoutError:
        job.cancelled = True
        return error_response(RequestError(HTTPStatus.GATEWAY_TIMEOUT, "generation did not finish within the "
                                           "server's request time limit", kind="timeout"))
    choices = [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
               for i, (text, finish) in enumerate(zip(completion.texts, completion.finish, strict=True))]
    return JSONResponse({"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                         "model": model, "choices": choices, "usage": usage(prompt_tokens, job)})


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def stream(model: str, job: Job, completion: Completion, deadline: float, prompt_tokens: int,
                 include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events as OpenAI streams them: a role chunk per choice, content deltas, a finish chunk per choice,
    the usage chunk when asked for, then ``[DONE]``."""
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> str:
        return sse({**base, "choices": [{"index": index, "delta": delta, "finish_reason": finish}]})

    try:
        for i in range(len(job.choices)):
            yield chunk(i, {"role": "assistant", "content": ""})
        while not completion.done():
            try:
                index, text, finish = await completion.next(deadline)
            except TimeoutError:
                job.cancelled = True
                yield sse({"error": {"message": "generation did not finish within the server's request time limit",
                                     "type": "timeout", "param": None, "code": "gateway_timeout"}})
                break
            if (error := failed(finish)) is not None:
                yield sse(error.body())
                break
            if text:
                yield chunk(index, {"content": text})
            if finish is not None:
                yield chunk(index, {}, finish)
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage(prompt_tokens, job)})
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled = job.cancelled or not completion.done()  # a client that went away frees its rows


def serve(checkpoint: Path, registry: Registry, host: str = "127.0.0.1", port: int = 8000,
          model_name: str | None = None, limits: ServeLimits = ServeLimits(),
          ready: Callable[[str], None] | None = None) -> None:
    """Load ``checkpoint`` once (its model and encoder looked up in ``registry``) and serve it until interrupted;
    ``ready(base_url)`` is called once the model is loaded, before the socket binds."""
    stitched = Stitched(Path(checkpoint), registry)
    served = ServedModel(stitched, model_name or stitched.model_spec.name, limits)
    protocol = type("Protocol", (GuardedH11Protocol,), {"header_timeout_s": limits.header_timeout_s})
    config = uvicorn.Config(create_app(served, limits), host=host, port=port, http=protocol, log_level="warning",
                            timeout_keep_alive=5, limit_concurrency=limits.max_connections,
                            h11_max_incomplete_event_size=64 * 1024, lifespan="off")
    if ready is not None:
        ready(f"http://{host}:{port}/v1")
    uvicorn.Server(config).run()
