"""`stitch prepare` images/s: N generated photo-like JPEGs decoded, resized and encoded once by the CLIP tower.

The product's prepare (its decode workers, slots and encode thread, as shipped) over a JSON-lines table of JPEG
files; images/s = rows / the prepare report's wall seconds (start-up included), with the report's phase seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

from benchmarks.common import log
from benchmarks.suites import harness


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--images", type=int, default=None, help="JPEGs to prepare (default 16384; tiny 64)")
    p.add_argument("--unique", type=int, default=1024, help="distinct JPEG contents among them")
    p.add_argument("--workers", type=int, default=None, help="prepare's decode workers (default: its own choice)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    tiny = args.shape == "tiny"
    n = args.images or (64 if tiny else 16384)
    shape = dataclasses.replace(harness.SHAPES[args.shape], model="qwen3.5-tiny")  # the LM only names a tokenizer
    harness.install_host()
    t0 = time.perf_counter()
    rows = harness.write_jpeg_rows(args.work / "data", n, unique=min(n, args.unique))
    generate_s = time.perf_counter() - t0
    extra = {"prepare": {"workers": args.workers}} if args.workers is not None else {}
    recipe = harness.write_recipe(args.work, shape, rows, n, {}, encode_batch_size=256, shard_rows=4096, **extra)
    report = harness.prepare(recipe, args.work / "run")
    images_per_s = n / report.seconds
    log(f"prepare: {n} images in {report.seconds:.1f} s = {images_per_s:.0f} images/s")
    figures = {"images": n, "images/s": round(images_per_s), "seconds": round(report.seconds, 1)}
    return {"encoder": shape.encoder, "images": n, "generate_s": round(generate_s, 1),
            "images_per_s": images_per_s, "seconds": report.seconds, "phase_seconds": report.phase_seconds,
            "encode_seconds": report.encode_seconds, "rows": [{"shape": args.shape, "figures": figures}]}
