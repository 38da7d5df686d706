"""The registered encoder's encode throughput (images/s): uint8 pixel batches through ``encode``, features out.

The encoder is built through its registration (``spec.load``, as prepare builds it) on this machine's device in
half precision on a GPU, compiled there as prepare compiles it for large jobs (`--eager`: not); pixels are
already decoded and resized (prepare's suite covers decoding).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from benchmarks.common import log, sync
from benchmarks.suites import harness


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=None, help="images per encode call (default 1024; tiny 16)")
    p.add_argument("--eager", action="store_true", help="skip the compile prepare does for large jobs")


def run(args: argparse.Namespace) -> dict[str, Any]:
    shape = harness.SHAPES[args.shape]
    batch = args.batch or (16 if args.shape == "tiny" else 1024)
    spec = harness.install_host().get("encoders", shape.encoder)
    dev = harness.device()
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    encoder = spec.load(spec.source, dev, dtype)
    compiled = dev == "cuda" and not args.eager and hasattr(encoder, "compile")
    if compiled:  # what prepare does past data.prepare.compile's threshold (the default for large jobs)
        encoder.compile(batch)
    pixels = torch.randint(0, 256, (batch, 3, 224, 224), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    times = []
    for i in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        features = encoder.encode(pixels)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    images_per_s = batch / statistics.median(times)
    log(f"encode: {tuple(features.shape)} per call, {images_per_s:.0f} images/s")
    figures = {"batch": batch, "compiled": compiled, "images/s": round(images_per_s)}
    return {"encoder": shape.encoder, "batch": batch, "compiled": compiled, "dtype": str(dtype),
            "feature_shape": list(features.shape),
            "images_per_s": images_per_s, "rows": [{"shape": args.shape, "figures": figures}]}
