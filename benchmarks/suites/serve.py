"""`stitch serve` under load: N openai clients at once against N one after another (throughput, p50/p99 latency),
and each streamed answer against its non-streamed one at temperature 0.

The server is `stitch serve CHECKPOINT` on a free loopback port (``--checkpoint``: a run directory, e.g. the one
`stitch run demo --out runs/demo` writes); every request asks about a scene of its own colour.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.common import log

QUESTION = "How many objects are in the image?"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", type=Path, required=True, help="a run directory or checkpoints root to serve")
    p.add_argument("--clients", type=int, default=32, help="requests sent at once (and one after another)")
    p.add_argument("--max-tokens", type=int, default=24)


def _scene(i: int) -> str:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (224, 224), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for k in range(1 + i % 5):
        x = 20 + 40 * k
        draw.ellipse((x, 80, x + 30, 110), fill=((37 * i) % 256, (91 * k) % 256, 160))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _start(checkpoint: Path) -> tuple[subprocess.Popen, int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "stitch", "serve", str(checkpoint), "--port", str(port),
                             "--model-name", "bench"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc, port
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("stitch serve did not start")


def _ask(client: Any, image: str, max_tokens: int, stream: bool = False) -> tuple[str, float]:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                             {"type": "text", "text": QUESTION}]}]
    t0 = time.perf_counter()
    reply = client.chat.completions.create(model="bench", messages=messages, max_tokens=max_tokens, temperature=0,
                                           stream=stream)
    text = ("".join(c.choices[0].delta.content or "" for c in reply if c.choices) if stream
            else reply.choices[0].message.content)
    return text, time.perf_counter() - t0


def _figures(latencies: list[float], wall: float) -> dict[str, float]:
    ordered = sorted(latencies)
    return {"requests/s": round(len(latencies) / wall, 2), "p50 s": round(statistics.median(ordered), 3),
            "p99 s": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import openai

    images = [_scene(i) for i in range(args.clients)]
    proc, port = _start(args.checkpoint)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        _ask(client, images[0], args.max_tokens)  # warm-up
        t0 = time.perf_counter()
        sequential = [_ask(client, image, args.max_tokens) for image in images]
        sequential_wall = time.perf_counter() - t0
        with ThreadPoolExecutor(args.clients) as pool:
            t0 = time.perf_counter()
            concurrent = list(pool.map(lambda image: _ask(client, image, args.max_tokens), images))
            concurrent_wall = time.perf_counter() - t0
            streamed = list(pool.map(lambda image: _ask(client, image, args.max_tokens, stream=True), images))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    answers = [text for text, _ in sequential]
    same_concurrent = sum(a == b for a, (b, _) in zip(answers, concurrent, strict=True))
    same_streamed = sum(a == b for a, (b, _) in zip(answers, streamed, strict=True))
    figures = {"sequential": _figures([s for _, s in sequential], sequential_wall),
               "concurrent": _figures([s for _, s in concurrent], concurrent_wall),
               "streamed = non-streamed": f"{same_streamed}/{args.clients}",
               "concurrent = sequential": f"{same_concurrent}/{args.clients}"}
    log(f"serve: {figures}")
    return {"clients": args.clients, "max_tokens": args.max_tokens, "figures": figures,
            "rows": [{"shape": args.shape, "figures": figures}]}
