"""`stitch serve` as a client sees it: the openai client's answers (streamed or not) equal `stitch infer`'s, concurrent
requests share decode steps, sampling fields are obeyed, a multi-turn two-image chat is rendered by the shared
prompt builder, and hostile clients get a 4xx or a closed connection while the server keeps answering."""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import subprocess
import threading
import time
import urllib.request

import pytest
import torch

from stitch.host.host import get_host
from stitch.rollout.prompts import MEDIA, conversation_prompt_ids, payload_for, prompt_embeddings
from stitch.serve.inference import Stitched
from tests.stitch_testing import cli, start_server

pytestmark = pytest.mark.slow

QUESTION = "How many objects are in the image?"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
MAX_REQUEST_MIB = 1
HEADER_TIMEOUT_S = 2
BODY_TIMEOUT_S = 2
BATCH_WAIT_MS = 500  # concurrent clients join one batch even when this machine is slow to take their requests


def _png(size: tuple[int, int] = (224, 224), color: tuple[int, int, int] = (200, 40, 40)) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def _image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def _user(*parts) -> dict:
    return {"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}


@pytest.fixture(scope="module")
def server(sft_run):
    proc, port = start_server(
        sft_run, "--model-name", "tiny", "--max-image-pixels", "250000", "--max-request-mib", str(MAX_REQUEST_MIB),
        "--header-timeout", str(HEADER_TIMEOUT_S), "--body-timeout", str(BODY_TIMEOUT_S), "--batch-wait-ms",
        str(BATCH_WAIT_MS), env=ENV)
    try:
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key="unused", max_retries=0)


def _ask(client, messages, **fields) -> str:
    fields = {"max_tokens": 24, "temperature": 0, **fields}
    return client.chat.completions.create(model="tiny", messages=messages, **fields).choices[0].message.content


def _health(port: int) -> dict:
    return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10).read())


def test_openai_client_gets_stitch_infers_answer_streamed_or_not_with_usage(client, sft_run, tmp_path):
    image = tmp_path / "scene.png"
    image.write_bytes(_png())
    messages = [_user(_image_part(image.read_bytes()), QUESTION)]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
    infer = subprocess.run(cli("infer", "--adapter", str(sft_run / "sft" / "checkpoints"), "--image", str(image),
                               "--question", QUESTION), capture_output=True, text=True, check=True, env=ENV)
    assert reply.choices[0].message.content + "\n" == infer.stdout
    assert reply.usage.prompt_tokens > 49 and reply.usage.completion_tokens > 0  # 49 soft tokens + the text
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens

    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == reply.choices[0].message.content
    assert sum(1 for d in deltas if d) > 1  # streamed piece by piece, not in one chunk
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reply.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_concurrent_clients_share_decode_steps_and_get_their_sequential_answers(client, server):
    colors = [(200, 40, 40), (40, 200, 40), (40, 40, 200), (200, 200, 40), (40, 200, 200), (200, 40, 200)]
    questions = [QUESTION, "Describe the image.", f"{QUESTION} Count every shape, small or large."]
    # prompts of different lengths: a batch left-pads them, which must not change any answer
    requests = [[_user(_image_part(_png(color=c)), questions[i % 3])] for i, c in enumerate(colors)]
    sequential = [_ask(client, m) for m in requests]
    before = _health(server)["batches"]
    answers: list[str | None] = [None] * len(requests)
    start = threading.Barrier(len(requests))

    def run(i: int) -> None:
        start.wait()
        answers[i] = _ask(client, requests[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    health = _health(server)
    batches = health["batches"] - before
    assert answers == sequential, f"batched {answers} != sequential {sequential}"
    assert batches < len(requests) and max(health["recent_batch_rows"][-batches:]) > 1, health["recent_batch_rows"]


def test_n_seed_top_p_stop_and_max_tokens_follow_the_request(client):
    messages = [_user(_image_part(_png()), QUESTION)]
    sample = {"n": 3, "temperature": 2.0, "max_tokens": 8}
    first = client.chat.completions.create(model="tiny", messages=messages, seed=5, **sample)
    again = client.chat.completions.create(model="tiny", messages=messages, seed=5, **sample)
    other = client.chat.completions.create(model="tiny", messages=messages, seed=6, **sample)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]
    assert texts != [c.message.content for c in other.choices] and len(set(texts)) > 1
    nucleus = client.chat.completions.create(model="tiny", messages=messages, seed=5, top_p=1e-6, **sample)
    greedy = _ask(client, messages, max_tokens=8)
    assert [c.message.content for c in nucleus.choices] == [greedy] * 3  # a tiny nucleus is the argmax

    short = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0, n=2)
    assert [c.finish_reason for c in short.choices] == ["length", "length"]
    assert short.usage.completion_tokens == 4
    answer = _ask(client, messages)
    stop = answer[len(answer) // 2 : len(answer) // 2 + 2]
    cut = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == answer[: answer.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_a_multi_turn_two_image_chat_is_answered_from_the_shared_prompt_builder(client, sft_run):
    red, blue = _png(color=(200, 40, 40)), _png(color=(40, 40, 200))
    messages = [_user(_image_part(red), QUESTION), {"role": "assistant", "content": "The answer is 1."},
                _user("And here?", _image_part(blue), QUESTION)]
    served = _ask(client, messages)

    stitched = Stitched(sft_run / "sft" / "checkpoints", get_host())
    rendered = [{"role": "user", "content": [MEDIA, QUESTION]}, messages[1],
                {"role": "user", "content": ["And here?", MEDIA, QUESTION]}]
    ids = conversation_prompt_ids(stitched.tokenizer, rendered, stitched.binding.sentinel_ids,
                                  stitched.encoder_spec.tokens_per_item)
    features = torch.cat([stitched.encode(red), stitched.encode(blue)])
    payload = payload_for(stitched.binding.registry, stitched.encoder_spec)
    with torch.no_grad():
        (embeds,) = prompt_embeddings(payload, stitched.model, [("chat", ids, features)])
        (completion,) = stitched.engine.generate([embeds], 1, 24, greedy=True)
    assert served == stitched.tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def _raw(port: int, request: bytes, timeout: float = 30) -> bytes:
    """Send ``request`` as is (never half-closed: asyncio servers drop a half-closed connection) and read the
    response until the server closes the connection (the requests say ``Connection: close``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        return b"".join(iter(lambda: sock.recv(65536), b""))


def _post(body: bytes, length: str | None = None) -> bytes:
    length = str(len(body)) if length is None else length
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: " + length.encode() + b"\r\n\r\n" + body)


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def test_hostile_requests_get_4xx_and_the_next_request_the_same_answer(client, server):
    from tests.serve.test_chat import _png_header

    messages = [_user(_image_part(_png()), QUESTION)]
    answer = _ask(client, messages)
    nested = b"[" * 100_000 + b"]" * 100_000
    bomb = json.dumps({"model": "tiny", "messages": [_user(_image_part(_png_header(20000, 20000)), QUESTION)]})
    hostile = {
        "Content-Length -1": _post(b"{}", "-1"),
        "Content-Length abc": _post(b"{}", "abc"),
        "invalid UTF-8": _post(b'{"model": "tiny\xff\xfe"}'),
        "100,000-deep nested JSON": _post(nested),
        "a 20000x20000 PNG": _post(bomb.encode()),
        "not JSON": _post(b"{'model'"),
    }
    for what, request in hostile.items():
        response = _raw(server, request)
        assert 400 <= _status(response) < 500, (what, response[:300])
        assert _ask(client, messages) == answer, f"the answer changed after: {what}"
    # over the cap: answered 413 while the client is still sending, so the server did not wait to read the rest
    cap = MAX_REQUEST_MIB * 2**20
    declared = _post(b"x" * 65536, str(cap + 1))
    chunk = b"%x\r\n" % 65536 + b"x" * 65536 + b"\r\n"
    chunked = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
               + chunk * (cap // 65536 + 2))  # no last chunk: the body never ends
    for what, request in {"a declared body over the cap": declared, "a chunked body over the cap": chunked}.items():
        assert _status(_raw(server, request)) == 413, what
        assert _ask(client, messages) == answer, f"the answer changed after: {what}"


def test_openai_errors_are_json_with_the_right_status(client, server):
    import openai

    messages = [_user(_image_part(_png()), QUESTION)]
    audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFF").decode(), "format": "wav"}}
    cases = {
        "unknown model": ({"model": "gpt-4o"}, 404),
        "bad base64": ({"messages": [_user({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}},
                                           QUESTION)]}, 400),
        "oversize image": ({"messages": [_user(_image_part(_png((1000, 1000)))), QUESTION]}, 400),
        "an audio part for an image encoder": ({"messages": [_user(audio, QUESTION)]}, 400),
        "last message not the user's": ({"messages": [*messages, {"role": "assistant", "content": "x"}]}, 400),
    }
    for what, (fields, status) in cases.items():
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(**{"model": "tiny", "messages": messages, "max_tokens": 4, **fields})
        assert caught.value.status_code == status, what
        assert caught.value.body["message"], what
    for path, status in (("/v1/nothing", 404), ("/v1/chat/completions", 405)):
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(f"http://127.0.0.1:{server}{path}", timeout=10)
        assert caught.value.code == status and json.loads(caught.value.read())["error"]["message"]


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_idle_slow_header_and_slow_body_connections_are_closed_on_time(client, server):
    idle = [socket.create_connection(("127.0.0.1", server)) for _ in range(40)]
    trickle = socket.create_connection(("127.0.0.1", server))
    slow_body = socket.create_connection(("127.0.0.1", server))
    slow_body.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    started = time.monotonic()
    for byte in b"POST /v1/chat/completions HTTP/1.1\r\n":  # one header byte at a time, never finishing
        try:
            trickle.sendall(bytes([byte]))
        except OSError:
            break
        time.sleep(0.1)
    deadline = started + HEADER_TIMEOUT_S + 5
    for sock in [*idle, trickle]:
        sock.settimeout(max(deadline - time.monotonic(), 0.1))
        assert _closed_by_server(sock), "an idle or slow-header connection stayed open"
        sock.close()
    slow_body.settimeout(BODY_TIMEOUT_S + 5)
    assert _status(slow_body.recv(4096)) == 408
    slow_body.close()
    assert time.monotonic() - started < HEADER_TIMEOUT_S + BODY_TIMEOUT_S + 10
    assert _ask(client, [_user(_image_part(_png()), QUESTION)], max_tokens=4)
