"""`stitch prepare` itself, timed on COCO-like JPEGs, plus encode-only throughput of its encoder path (issue 14.5).

The encoder is the shipped CLIP plugin path (``stitch_clip.encoder.load_clip``: sdpa, the unused last layer
dropped, uint8 pixels normalised on the device) over the real clip-vit-base-patch32 config with random weights
(speed does not depend on their values; nothing is downloaded). It is registered in-process as
``clip-b32-random`` with the real ``CLIP_B32`` spec's contract, so prepare runs exactly as for the real one.

1. JPEGs: ``--unique`` distinct photo-like images (waves + shapes + sensor noise, 480-640 x 360-480, some
   portrait, quality 90), written by worker processes; each of the ``--images`` files is one of them with its own
   JPEG comment segment, so every file has distinct bytes (prepare's shards are content-addressed: identical
   bytes would be reused shards, not encoded ones). A JSON-lines dataset in stitch's local format points at them.
2. ``prepare()`` (the function ``stitch prepare`` calls) end to end, on ``--device``: whole-run images/s, and
   steady state from prepare's own progress (the rows done after the first shard).
3. Encode only, on one uint8 batch already on the host: the shipped ``ClipImageEncoder.encode`` at each batch in
   ``--batches``, eager / ``torch.compile`` default / ``reduce-overhead`` / ``max-autotune`` / channels_last, and
   stock transformers (``CLIPImageProcessor`` tensors + eager ``CLIPVisionModel``, ``hidden_states[-2]``) on the
   same images; each variant's features are compared with the stock ones (max |diff|, min cosine).

4. ``--cpu-pipeline``: prepare's pipeline alone, on this machine: the same JPEGs, workers and CLIP preprocessing,
   the encoder replaced by a null tower (a preallocated zero tensor of the declared shape), so what is left is
   the main process's per-row work and the workers' decode. Prints prepare-report.json's ``phase_seconds`` (where
   the main process's wall time went) and ``worker_seconds`` (tokenizing and decoding, summed over chunks), the
   main process's CPU seconds, its seconds per row outside start-up and waiting, and what that bounds the
   throughput to for ``--project-workers`` workers. ``--profile`` adds the main thread's cProfile (top 25).

    PYTHONPATH=. python3 benchmarks/prepare_stitch.py --out $OUT          # H200
    PYTHONPATH=. python benchmarks/prepare_stitch.py --smoke --out /tmp/b  # CPU, seconds
    PYTHONPATH=. python benchmarks/prepare_stitch.py --cpu-pipeline --images 4096 --workers 1 --out /tmp/b
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import io
import json
import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import log, now, peak_gib, profile_once, reset_peak, write_result  # noqa: E402

ENCODER = "clip-b32-random"


def b32_config(smoke: bool):
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=2 if smoke else 12,
                            num_attention_heads=12, image_size=224, patch_size=32, projection_dim=512,
                            hidden_act="quick_gelu", layer_norm_eps=1e-5)


def build_b32_random(out_dir: Path, smoke: bool = False) -> None:
    from transformers import CLIPImageProcessor, CLIPVisionModel

    torch.manual_seed(0)
    CLIPVisionModel(b32_config(smoke)).save_pretrained(out_dir, safe_serialization=True)
    CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224},
                       image_mean=[0.48145466, 0.4578275, 0.40821073],
                       image_std=[0.26862954, 0.26130258, 0.27577711]).save_pretrained(out_dir)


def build_b32_smoke(out_dir: Path) -> None:
    build_b32_random(out_dir, smoke=True)


class NullTower:
    """An encoder that costs nothing: the declared [B, 49, 768] features, zeros, already in the feature dtype."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.zeros = torch.zeros(0, 49, 768, dtype=dtype)

    def encode(self, items) -> torch.Tensor:
        if len(items) > len(self.zeros):
            self.zeros = torch.zeros(len(items), 49, 768, dtype=self.zeros.dtype)
        return self.zeros[: len(items)]


def bench_host(smoke: bool, null_tower: bool = False):
    from stitch.plugins.hookspecs import hookimpl
    from stitch.host.host import load_plugins
    from stitch.plugins.specs import ModelSource
    from stitch_clip.encoder import CLIP_B32

    builder = build_b32_smoke if smoke else build_b32_random
    spec = dataclasses.replace(CLIP_B32, name=ENCODER, description="ViT-B/32 config, random weights (benchmark)",
                               source=ModelSource(builder=builder, builder_key=f"{ENCODER}-{int(smoke)}-v1"))
    if null_tower:  # prepare still loads it through the spec (in its loader thread), preprocesses as CLIP does
        spec = dataclasses.replace(spec, load=lambda source, device, dtype: NullTower(dtype))

    class BenchPlugin:
        @staticmethod
        @hookimpl
        def register_encoders(register):
            register(spec)

    return load_plugins(extra={"prepare-stitch-bench": BenchPlugin}), spec


# -- JPEGs ----------------------------------------------------------------------------------------------------


def _photo_jpeg(seed: int, smoke: bool) -> bytes:
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    w, h = (int(rng.integers(480, 641)), int(rng.integers(360, 481)))
    if smoke:
        w, h = w // 2, h // 2
    if rng.random() < 0.25:
        w, h = h, w  # portrait
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    chans = [np.sin(xx / rng.uniform(6, 60) + rng.uniform(0, 6)) * np.cos(yy / rng.uniform(6, 60)) * 90 + 128
             for _ in range(3)]
    img = Image.fromarray(np.stack(chans, -1).clip(0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(4, 12))):
        x0, y0 = int(rng.integers(0, w - 20)), int(rng.integers(0, h - 20))
        box = (x0, y0, x0 + int(rng.integers(10, w // 2)), y0 + int(rng.integers(10, h // 2)))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    noisy = np.asarray(img).astype(np.int16) + rng.normal(0, 7, (h, w, 3)).astype(np.int16)
    buf = io.BytesIO()
    Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _write_jpegs(job: tuple[str, int, int, int, int, bool]) -> int:
    """Contents ``first..last-1``, each encoded once and written as every file ``i`` with ``i % unique`` equal."""
    folder, first, last, n, unique, smoke = job
    total = 0
    for content in range(first, last):
        base = _photo_jpeg(content, smoke)
        for i in range(content, n, unique):
            text = f"stitch-bench {i}".encode()
            data = base[:2] + b"\xff\xfe" + (len(text) + 2).to_bytes(2, "big") + text + base[2:]  # SOI, COM, rest
            Path(folder, f"{i:07d}.jpg").write_bytes(data)
            total += len(data)
    return total


def make_dataset(root: Path, n: int, unique: int, workers: int, smoke: bool) -> dict:
    import multiprocessing as mp

    shutil.rmtree(root, ignore_errors=True)
    (root / "imgs").mkdir(parents=True)
    t0 = time.perf_counter()
    unique = min(unique, n)
    step = max(1, -(-unique // (workers * 2)))
    jobs = [(str(root / "imgs"), s, min(unique, s + step), n, unique, smoke) for s in range(0, unique, step)]
    with mp.get_context("fork").Pool(workers) as pool:
        total = sum(pool.map(_write_jpegs, jobs))
    with open(root / "rows.jsonl", "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"img{i}", "image": f"imgs/{i:07d}.jpg", "question": "What is shown?",
                                 "answer": f"picture {i % 97}"}) + "\n")
    return {"images": n, "unique_contents": min(unique, n), "mean_jpeg_kib": round(total / n / 1024, 1),
            "generate_s": round(time.perf_counter() - t0, 1)}


def write_recipe(root: Path, n: int, args) -> Path:
    import yaml

    prepare_opts = {"compile": args.compile, "decode": args.decode,
                    **({"workers": args.workers} if args.workers is not None else {})}
    recipe = {
        "name": "prepare-bench", "model": "qwen3.5-tiny", "encoder": ENCODER,
        "data": {
            "source": {"path": str(root / "rows.jsonl"), "format": "json"},
            "columns": {"id": "id", "media": "image", "question": "question", "answer": "answer"},
            "partitions": {"train": [0, n]}, "scan_cap": n,
            "budgets": {"transient_mib": 4096, "retained_mib": 1 + n * 49 * 768 * 2 * 1.1 / 2**20},
            "feature_dtype": "bfloat16", "encode_batch_size": args.encode_batch, "shard_rows": args.shard_rows,
            "prepare": prepare_opts,
        },
    }
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


class ProgressClock:
    """Wraps prepare's tqdm bar: when each row finished, to separate start-up from steady state."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, int]] = []

    def install(self):
        import stitch.data.prepare as prep

        original = prep._progress
        clock = self

        class Bar:
            def __init__(self, bar):
                self.bar, self.done = bar, 0

            def update(self, k):
                self.done += k
                clock.marks.append((time.perf_counter(), self.done))
                return self.bar.update(k)

            def __getattr__(self, name):
                return getattr(self.bar, name)

        import contextlib

        @contextlib.contextmanager
        def progress(total, enabled):
            with original(total, enabled) as bar:
                yield Bar(bar)

        prep._progress = progress
        return original


def preprocess_identity(host, recipe, device: str) -> str | None:
    """The identity of the preprocessing the run used (its shards are keyed by it): the workers' or the device's."""
    from stitch.data.prepare import preprocess_for

    preprocess = preprocess_for(host.get("encoders", recipe.encoder).preprocess(), device, recipe.data.prepare.decode)
    return getattr(preprocess, "identity", None)


def thread_cpu_now() -> dict[int, tuple[str, float]]:
    """tid -> (comm, CPU seconds: utime + stime, fields 14 and 15 of /proc's stat) of this process's threads."""
    ticks, out = os.sysconf("SC_CLK_TCK"), {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # it ended between the listing and the read
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(task.name)] = (stat[stat.index("(") + 1 : stat.rindex(")")], (int(fields[11]) + int(fields[12])) / ticks)
    return out


class ThreadCpu:
    """CPU seconds of each thread of this process while prepare runs (``--thread-cpu``), sampled every 50 ms by
    a thread of its own, so threads that end early (the loader, the decoder's warm-up) are counted up to their
    last sample. Python threads by name; the others (CUDA's, OpenMP's) by their comm, in brackets."""

    def __enter__(self) -> ThreadCpu:
        self.start = {tid: cpu for tid, (_, cpu) in thread_cpu_now().items()}
        self.seen: dict[int, tuple[str, float]] = {}  # tid -> (name, last CPU seconds)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.sample, name="bench-thread-cpu", daemon=True)
        self.thread.start()
        return self

    def sample(self) -> None:
        while True:
            names = {t.native_id: t.name for t in threading.enumerate()}
            for tid, (comm, cpu) in thread_cpu_now().items():
                self.seen[tid] = (names.get(tid) or self.seen.get(tid, (f"[{comm}]",))[0], cpu)
            if self.stop.wait(0.05):
                return

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def by_name(self) -> dict[str, float]:
        """CPU seconds during the run, summed over threads of one name, largest first."""
        out: dict[str, float] = {}
        for tid, (name, cpu) in self.seen.items():
            out[name] = out.get(name, 0.0) + cpu - self.start.get(tid, 0.0)
        return {k: round(v, 2) for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v >= 0.01}


@contextlib.contextmanager
def timed_calls(cls: Any, name: str, spans: list[tuple[float, float]]):
    """``cls.name`` (if it exists; a class's method or a module's function) appending each call's (start, end) to
    ``spans`` while the block runs."""
    method = getattr(cls, name, None)
    if method is None:
        yield
        return

    def timed(self, *a, **k):
        began = time.perf_counter()
        try:
            return method(self, *a, **k)
        finally:
            spans.append((began, time.perf_counter()))

    setattr(cls, name, timed)
    try:
        yield
    finally:
        setattr(cls, name, method)


class GcPauses:
    """Python's cyclic collections while prepare runs (``gc.callbacks``): each stops every thread of the process
    for its duration, and a full (generation 2) one walks every tracked object, imports and model included."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, float, float]] = []  # generation, start, seconds
        self.callers: list[list[str]] = []  # each full collection's innermost frames
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            if info["generation"] == 2:  # who asked: an explicit gc.collect() or the allocation that set it off
                import traceback

                self.callers.append([f"{threading.current_thread().name} {Path(f.filename).name}:{f.lineno} {f.name}"
                                     for f in traceback.extract_stack(limit=8)[:-1]])
        else:
            self.runs.append((info["generation"], self._started, time.perf_counter() - self._started))

    def __enter__(self) -> GcPauses:
        # prepare freezes and pauses collection only where nothing froze objects before it
        self.at_start = {"frozen_objects": gc.get_freeze_count(), "enabled": gc.isenabled()}
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self)

    def summary(self, t0: float) -> dict:
        out: dict[str, Any] = {}
        for gen in (0, 1, 2):
            runs = [r for r in self.runs if r[0] == gen]
            out[f"gen{gen}"] = {"count": len(runs), "seconds": round(sum(r[2] for r in runs), 3)}
        out["gen2_at_s"] = [[round(start - t0, 3), round(seconds, 3)] for gen, start, seconds in self.runs
                            if gen == 2]
        out["gen2_callers"] = self.callers
        out["at_start"] = self.at_start
        return out


def run_prepare(args, host, root: Path, n: int, device: str) -> dict:
    from stitch.config.recipe import load_recipe
    from stitch.data.prepare import prepare

    recipe = load_recipe(write_recipe(root, n, args))
    # the model's tokenizer on disk first, as a user's downloaded model is: on a fresh machine the tiny preset is
    # built here (a trained tokenizer, random weights), which is not prepare's work; its time is reported apart
    from stitch.model.binding import ModelBinding

    t_model = time.perf_counter()
    ModelBinding.for_recipe(recipe, host=host, device="cpu").tokenizer  # noqa: B018 - builds and loads it once
    model_ready_s = time.perf_counter() - t_model
    out = root / "prepared"
    shutil.rmtree(out, ignore_errors=True)
    clock = ProgressClock()
    clock.install()
    profile = None
    if getattr(args, "profile", False):
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    import stitch.data.prepare as prepare_module
    import stitch_clip.encoder as clip_encoder

    # when each shard's encode (the encode thread) and each device_batch call (the device path's inputs) began and
    # ended; the code before the encode thread has no encode_shard
    shards: list[tuple[float, float]] = []
    batches: list[tuple[float, float]] = []
    writes: list[tuple[float, float]] = []  # each shard file's write + sha256 on the writer thread (round 19)
    sampler = ThreadCpu() if getattr(args, "thread_cpu", False) else contextlib.nullcontext()
    pauses = GcPauses()
    t0, cpu0 = time.perf_counter(), time.process_time()
    with sampler, pauses, timed_calls(prepare_module._Preparation, "encode_shard", shards), \
            timed_calls(clip_encoder.ClipDeviceGeometry, "device_batch", batches), \
            timed_calls(prepare_module, "write_shard", writes):
        report = prepare(recipe, out, host=host, device=device, progress=False)
    total, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if profile is not None:
        profile.disable()
    first = next(((t, k) for t, k in clock.marks if k >= args.shard_rows), clock.marks[0])
    steady = (n - first[1]) / max(clock.marks[-1][0] - first[0], 1e-9)
    result = {
        "images": report.total_rows, "seconds": round(total, 2), "images_per_s": round(report.total_rows / total, 1),
        "steady_images_per_s": round(steady, 1), "first_shard_s": round(first[0] - t0, 2),
        "shards_encoded": report.shards_encoded, "skipped": len(report.skipped),
        "workers": recipe.data.prepare.worker_count, "compile": recipe.data.prepare.compile,
        "compiled": recipe.data.prepare.compiles(device, n), "encode_batch_size": recipe.data.encode_batch_size,
        "shard_rows": recipe.data.shard_rows, "retained_mib": round(report.retained_bytes / 2**20, 1),
        "phase_seconds": getattr(report, "phase_seconds", None), "worker_seconds": getattr(report, "worker_seconds", None),
        "encode_seconds": getattr(report, "encode_seconds", None),
        "shard_encodes_s": [[round(a - t0, 3), round(b - t0, 3)] for a, b in shards],
        "device_batches_s": [[round(a - t0, 3), round(b - t0, 3)] for a, b in batches],
        "shard_writes_s": [[round(a - t0, 3), round(b - t0, 3)] for a, b in writes],
        "writer_busy_s": round(sum(b - a for a, b in writes), 3),
        "shard_writers": prepare_module.SHARD_WRITERS, "shard_writer": prepare_module.write_tensor_file.__name__,
        "gc": pauses.summary(t0),
        "main_cpu_s": round(cpu, 2), "media_chunks": getattr(report, "media_chunks", None),
        "thread_cpu_s": sampler.by_name() if isinstance(sampler, ThreadCpu) else None,
        "decode": recipe.data.prepare.decode, "preprocess": preprocess_identity(host, recipe, device),
        "model_tokenizer_ready_s": round(model_ready_s, 2),
        "model_tokenizer_note": "building (fresh machine) or loading the recipe model's tokenizer once before the "
                                "timed call, as a user's model is downloaded before `stitch prepare`; not included",
    }
    phases = result["phase_seconds"]
    if phases:  # the main thread's own work per row: not start-up, not waiting for workers, encoder or writer
        waits = ("tokenizer_load", "workers_start", "stream_open", "startup", "media_wait", "encoder_load",
                 "encode_wait", "write_wait")
        own = phases["total"] - sum(phases.get(k, 0.0) for k in waits)
        result["main_ms_per_row"] = round(own / max(report.total_rows, 1) * 1e3, 4)
        encoding = result["encode_seconds"] or {}
        if "encode" in encoding:  # the encode thread's (a shard encodes while the main thread gathers the next)
            result["encode_thread_ms_per_row"] = round(encoding["encode"] / max(report.total_rows, 1) * 1e3, 4)
    if profile is not None:
        import io
        import pstats

        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
        if args.out:  # the whole profile, for callers and cumulative views (python -m pstats FILE)
            profile.dump_stats(str(Path(args.out) / f"{args.name}.pstats"))
        result["profile_top25"] = text.getvalue().splitlines()
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return result


# -- encode only ----------------------------------------------------------------------------------------------


def sample_images(root: Path, count: int) -> list[bytes]:
    files = sorted((root / "imgs").glob("*.jpg"))
    return [files[i % len(files)].read_bytes() for i in range(count)]


@torch.no_grad()
def encode_only(args, spec, root: Path, device: str) -> dict:
    from transformers import CLIPImageProcessor, CLIPVisionModel

    from stitch_clip.encoder import clip_geometry, decode_image

    dtype = torch.bfloat16
    kwargs = spec.source.pretrained_kwargs()
    processor = CLIPImageProcessor.from_pretrained(**kwargs)
    geometry = clip_geometry(processor)
    biggest = max(args.batches)
    raws = sample_images(root, min(biggest, args.check_images))
    # one uint8 batch as prepare's workers make it, tiled to the largest batch
    base = torch.stack([geometry(r) for r in raws])
    uint8 = base.repeat((biggest + len(raws) - 1) // len(raws), 1, 1, 1)[:biggest].contiguous()
    uint8 = uint8.pin_memory() if device.startswith("cuda") else uint8
    stock_pixels = processor(images=[decode_image(r) for r in raws], return_tensors="pt")["pixel_values"]

    stock = CLIPVisionModel.from_pretrained(**kwargs, attn_implementation="eager").to(device, dtype).eval()
    reference = stock(pixel_values=stock_pixels.to(device, dtype), output_hidden_states=True).hidden_states[-2][:, 1:]
    reference = reference.float()

    def timed(fn, batch: int) -> tuple[float, float]:
        t0 = now()
        for _ in range(args.warmup):
            fn(batch)
        warm = now() - t0
        reset_peak()
        t0 = now()
        for _ in range(args.iters):
            fn(batch)
        return batch * args.iters / (now() - t0), warm

    def compare(features: torch.Tensor) -> dict:
        got = features[: len(raws)].float()
        cos = torch.nn.functional.cosine_similarity(got.flatten(1), reference.flatten(1)).min().item()
        rel = ((got - reference).norm(dim=(1, 2)) / reference.norm(dim=(1, 2))).max().item()
        return {"max_abs_diff_vs_stock": (got - reference).abs().max().item(), "min_cosine_vs_stock": round(cos, 6),
                "max_rel_l2_vs_stock": round(rel, 5)}

    results: dict = {}

    def stock_run(batch: int) -> torch.Tensor:  # pixels as the processor made them, already float on the host
        pixels = stock_pixels.repeat((batch + len(raws) - 1) // len(raws), 1, 1, 1)[:batch]
        return stock(pixel_values=pixels.to(device, dtype), output_hidden_states=True).hidden_states[-2][:, 1:]

    # name -> torch.compile mode (None: eager), whether the batch goes to the GPU in ``pipeline_chunk`` chunks
    # copied on a side stream (shipped) or as one copy followed by the tower (``_serial``, the previous order), and
    # options: ``sdpa`` restricts sdpa to one backend, ``attn`` sets transformers' attention implementation, ``prev``
    # builds the encoder from ``--prev-encoder`` (an older stitch_clip/encoder.py) for a same-run baseline
    variants = {"stitch_eager": (None, True, {}), "stitch_eager_serial": (None, False, {}),
                "stitch_compile": ("default", True, {}), "stitch_compile_serial": ("default", False, {}),
                "stitch_reduce_overhead": ("reduce-overhead", True, {}),
                "stitch_max_autotune": ("max-autotune", True, {}),
                "stitch_channels_last": ("channels_last", True, {}),
                "stitch_eager_prev": (None, True, {"prev": True}),
                "stitch_compile_prev": ("default", True, {"prev": True}),
                "stitch_eager_flash": (None, True, {"sdpa": "FLASH_ATTENTION"}),
                "stitch_eager_efficient": (None, True, {"sdpa": "EFFICIENT_ATTENTION"}),
                "stitch_compile_flash": ("default", True, {"sdpa": "FLASH_ATTENTION"}),
                "stitch_compile_efficient": ("default", True, {"sdpa": "EFFICIENT_ATTENTION"}),
                "stitch_compile_cudnn": ("default", True, {"sdpa": "CUDNN_ATTENTION"}),
                "stitch_compile_math": ("default", True, {"sdpa": "MATH"}),
                "stitch_compile_eager_attn": ("default", True, {"attn": "eager"}),
                # the tower before stitch_vit (round 23): transformers' sdpa, torch's kernel pick, everything else alike
                "stitch_eager_sdpa": (None, True, {"attn": "sdpa"}),
                "stitch_compile_sdpa": ("default", True, {"attn": "sdpa"}),
                # a call's chunks encoded on two streams in turn (ClipImageEncoder.compute_streams at 2a2dcfb: +1.5-2 %
                # on a power-throttled H200, not shipped; BENCHMARKS §0v)
                "stitch_compile_2s": ("default", True, {"streams": 2}),
                "stitch_compile_2s512": ("default", True, {"streams": 2, "chunk": 512}),
                "stitch_reduce_overhead_2s512": ("reduce-overhead", True, {"streams": 2, "chunk": 512}),
                # compiled with the MLPs as transformers has them: fc1's bias + quick-GELU not one quack GEMM (§0w)
                "stitch_compile_unfused": ("default", True, {"unfused": True}),
                "stitch_compile_qkv": ("default", True, {"qkv": True}),
                "stitch_compile_qkv_flash": ("default", True, {"qkv": True, "sdpa": "FLASH_ATTENTION"}),
                "stitch_compile_qkv_efficient": ("default", True, {"qkv": True, "sdpa": "EFFICIENT_ATTENTION"})}
    chosen = args.variants.split(",")
    for name in chosen:  # stitch_compile_h<H>_w<W>: stitch_vit launched with H heads and W warps a program
        if (launch := re.fullmatch(r"stitch_compile_h(\d+)_w(\d+)", name)):
            variants[name] = ("default", True, {"launch": {"heads": int(launch[1]), "num_warps": int(launch[2])}})
        # stitch_{compile,reduce_overhead}_chunk<N>: N images a compiled call; stitch_compile_mlp<R>: each MLP in
        # R-row chunks (round 24: its [R, 3,072] intermediate held in L2)
        if (chunked := re.fullmatch(r"stitch_(compile|reduce_overhead)_chunk(\d+)", name)):
            variants[name] = (chunked[1].replace("_", "-").replace("compile", "default"), True,
                              {"chunk": int(chunked[2])})
        if (rows := re.fullmatch(r"stitch_compile_mlp(\d+)", name)):
            variants[name] = ("default", True, {"mlp_rows": int(rows[1])})
    for batch in args.batches:
        row: dict = {}
        ips, warm = timed(lambda b: stock_run(b), batch)
        row["stock_transformers"] = {"images_per_s": round(ips, 1), "warmup_s": round(warm, 2), "peak_gib": peak_gib(),
                                     "note": "processor pixels precomputed (host float32 -> device), eager, full tower"}
        for name in chosen:
            mode, pipelined, options = variants[name]
            if mode not in (None, "channels_last") and batch not in args.compile_batches:
                continue
            encoder = prev_encoder(args.prev_encoder, spec, device, dtype) if options.get("prev") else \
                spec.load(spec.source, device, dtype)
            if not pipelined:
                encoder.pipeline_chunk = None
            if "chunk" in options:
                encoder.pipeline_chunk = options["chunk"]
            if "streams" in options:
                if not hasattr(encoder, "compute_streams"):
                    raise RuntimeError("this encoder has no compute_streams (git checkout 2a2dcfb -- "
                                       "stitch_clip/encoder.py)")
                encoder.compute_streams = options["streams"]
            if "attn" in options:
                encoder.model.set_attn_implementation(options["attn"])
            if options.get("qkv"):
                attention_as_one_qkv_gemm(encoder.model)
            if "mlp_rows" in options:
                mlp_in_row_chunks(encoder.model, options["mlp_rows"])
            from stitch_clip import attention

            shipped_launch = dict(attention.LAUNCH)
            attention.LAUNCH.update(options.get("launch", {}))  # read at each call, also inside a compiled tower
            if mode == "channels_last":
                encoder.model = encoder.model.to(memory_format=torch.channels_last)
            elif mode is not None:  # as ClipImageEncoder.compile does, with the mode
                # a fresh trace and compile: dynamo does not guard on sdpa's backend switches, and inductor's FX
                # graph cache keys the graph before sdpa picks its kernel, so a variant that differs only in them
                # would run the previous variant's code (prepare12 and prepare12b did: cuDNN's kernel every time)
                from torch._functorch import config as functorch_config
                from torch._inductor import config as inductor_config

                torch._dynamo.reset()
                inductor_config.fx_graph_cache = "sdpa" not in options
                functorch_config.enable_autograd_cache = "sdpa" not in options
                encoder.compile(batch)  # which also fuses the MLPs' fc1 + GELU on a Hopper GPU with quack
                if options.get("unfused"):
                    from stitch_clip.gemm import unfuse_quick_gelu

                    unfuse_quick_gelu(encoder.model)
                encoder._tower = torch.compile(encoder._patches, dynamic=False, mode=mode)
            # sdpa restricted to one kernel around every call (a compiled variant's first call traces inside it)
            backend = [getattr(torch.nn.attention.SDPBackend, options["sdpa"])] if "sdpa" in options else None
            kernel = (lambda b=backend: torch.nn.attention.sdpa_kernel(b)) if backend else contextlib.nullcontext

            def encode(b: int, e=encoder, kernel=kernel) -> torch.Tensor:
                with kernel():
                    return e.encode(uint8[:b])

            try:
                ips, warm = timed(encode, batch)
                row[name] = {"images_per_s": round(ips, 1), "warmup_s": round(warm, 2), "peak_gib": peak_gib(),
                             **compare(encode(len(raws)))}
                if args.profile_encode and device.startswith("cuda"):
                    row[name]["profile"] = profile_once(lambda b=batch: encode(b), top=16)
            except Exception as exc:  # a variant that does not build is reported, the others still run
                row[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            attention.LAUNCH.update(shipped_launch)
            del encoder
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
        base = row["stock_transformers"]["images_per_s"]
        for value in row.values():
            if "images_per_s" in value:
                value["ratio_vs_stock"] = round(value["images_per_s"] / base, 3)
        for name, value in row.items():
            log(f"encode b{batch} {name:24s} {value.get('images_per_s', value.get('error'))}")
        results[str(batch)] = row
    return results


class QkvAttention(torch.nn.Module):
    """CLIP's attention with its q, k and v projections as one GEMM (``attention_as_one_qkv_gemm`` switches a
    loaded ``CLIPAttention`` to it in place; the tower is frozen, so the three weights are concatenated once), then
    the tower's attention implementation (stitch_vit or sdpa) on strided views of the product. The
    ``stitch_compile_qkv`` variants; not shipped: on the H200 cuBLAS ran the fused [51,200 x 768] x [768 x 2,304]
    GEMM slower than the three it replaces (prepare12b, BENCHMARKS §0k)."""

    num_heads: int
    head_dim: int
    scale: float
    qkv: torch.nn.Linear
    out_proj: torch.nn.Linear

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, None]:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        b, s, _ = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(b, s, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        attend = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]  # stitch_vit or sdpa, as the tower's
        out, _ = attend(self, q, k, v, attention_mask, scaling=self.scale)
        return self.out_proj(out.reshape(b, s, -1)), None


def attention_as_one_qkv_gemm(model: Any) -> int:
    """Switch every ``CLIPAttention`` of ``model`` to ``QkvAttention``; the number switched."""
    switched = 0
    for module in model.modules():
        if type(module).__name__ != "CLIPAttention" or module.training:
            continue
        projections = (module.q_proj, module.k_proj, module.v_proj)
        fused = torch.nn.Linear(module.embed_dim, 3 * module.embed_dim, device=module.q_proj.weight.device,
                                dtype=module.q_proj.weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([p.weight for p in projections]))
            fused.bias.copy_(torch.cat([p.bias for p in projections]))
        del module.q_proj, module.k_proj, module.v_proj
        module.qkv = fused.requires_grad_(False)
        module.__class__ = type("CLIPQkvAttention", (QkvAttention, type(module)), {})
        switched += 1
    return switched


def mlp_in_row_chunks(model: Any, rows: int) -> int:
    """Every ``CLIPMLP`` of ``model`` run over its flattened tokens in ``rows``-row chunks (benchmarks/mlp_l2.py
    times one alone); the number switched."""
    switched = 0
    for module in model.modules():
        if type(module).__name__ != "CLIPMLP":
            continue

        def forward(hidden_states: torch.Tensor, m=module) -> torch.Tensor:
            flat = hidden_states.reshape(-1, hidden_states.shape[-1])
            out = torch.cat([m.fc2(m.activation_fn(m.fc1(flat[s : s + rows]))) for s in range(0, flat.shape[0], rows)])
            return out.view(*hidden_states.shape[:-1], -1)

        module.forward = forward
        switched += 1
    return switched


def prev_encoder(path: str | None, spec, device: str, dtype: torch.dtype):
    """The encoder as an older ``stitch_clip/encoder.py`` (``--prev-encoder``, e.g. ``git show REV:stitch_clip/
    encoder.py > .bench-old/encoder.py``) builds it, from the same snapshot: the baseline of an encoder change, timed
    in the same process."""
    import importlib.util

    if not path:
        raise SystemExit("a _prev variant needs --prev-encoder")
    module_spec = importlib.util.spec_from_file_location("prev_clip_encoder", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.load_clip(spec.source, device, dtype)


def loader_breakdown(spec, device: str, batch: int) -> dict:
    """What prepare's encoder loader thread does, step by step in this fresh process with nothing beside it:
    importing ``datasets`` (the main thread's ``stream_open`` does that meanwhile), the device's context, the
    tower's ``load`` (``from_pretrained`` + cast + copy), its ``warm_up(batch)`` and the device preprocessing's
    ``warm_up(device)``; seconds each, synchronised."""
    def timed(fn) -> float:
        started = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return round(time.perf_counter() - started, 3)

    steps: dict[str, float] = {}
    if device.startswith("cuda"):  # first: timed()'s synchronise would make the context inside the step before
        steps["cuda_context"] = timed(lambda: torch.zeros(1, device=device))
    steps["import_datasets"] = timed(lambda: __import__("datasets"))
    made: list[Any] = []  # the preprocessing, then the encoder
    steps["snapshot_ready"] = timed(lambda: made.append(spec.preprocess()))  # builds the random snapshot once
    steps["load"] = timed(lambda: made.append(spec.load(spec.source, device, torch.bfloat16)))
    steps["encoder_warm_up"] = timed(lambda: made[1].warm_up(batch))
    on_device = getattr(made[0], "on_device", None)
    geometry = on_device(device) if callable(on_device) else None
    if callable(getattr(geometry, "warm_up", None)):
        steps["decoder_warm_up"] = timed(lambda: geometry.warm_up(device))
    steps["load_again"] = timed(lambda: spec.load(spec.source, device, torch.bfloat16))  # imports and context paid
    return steps


def project(result: dict, workers: int) -> dict:
    """Images/s the pipeline allows with ``workers`` decode workers on cores like these: the slower of the
    workers (each row costs them ``worker_seconds`` / rows, run in parallel) and the main process (its own
    seconds per row, serial). An upper bound: it leaves out start-up and the encoder."""
    rows = result["images"]
    worker_s = sum(result["worker_seconds"].values()) / rows
    main_s = result["main_ms_per_row"] / 1e3
    encode_s = result.get("encode_thread_ms_per_row", 0.0) / 1e3
    bounds = [workers / worker_s, 1 / main_s] + ([1 / encode_s] if encode_s else [])
    return {"workers": workers, "worker_ms_per_row": round(worker_s * 1e3, 4),
            "main_ms_per_row": result["main_ms_per_row"], "workers_bound_images_per_s": round(workers / worker_s),
            "main_bound_images_per_s": round(1 / main_s),
            "encode_thread_bound_images_per_s": round(1 / encode_s) if encode_s else None,
            "images_per_s": round(min(bounds))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=16384)
    ap.add_argument("--unique", type=int, default=512, help="distinct image contents (each file's bytes differ)")
    ap.add_argument("--workers", type=int, default=None, help="data.prepare.workers (default: the recipe default)")
    ap.add_argument("--compile", default="auto", choices=["auto", "always", "never"], help="data.prepare.compile")
    ap.add_argument("--decode", default="cpu", choices=["cpu", "device"],
                    help="data.prepare.decode (device: JPEGs decode on the GPU, with torchvision)")
    ap.add_argument("--encode-batch", type=int, default=1024, help="data.encode_batch_size")
    ap.add_argument("--shard-rows", type=int, default=2048, help="data.shard_rows")
    ap.add_argument("--batches", default="1024,2048,4096", help="encode-only batch sizes")
    ap.add_argument("--variants", default="stitch_eager,stitch_eager_serial,stitch_compile,stitch_compile_serial",
                    help="also: stitch_reduce_overhead, stitch_channels_last, stitch_max_autotune (minutes), "
                    "stitch_{eager,compile}_prev (--prev-encoder), stitch_compile_{flash,efficient,cudnn,math} (sdpa "
                    "restricted to one backend), stitch_compile_eager_attn, stitch_{eager,compile}_sdpa (the tower before stitch_vit), stitch_compile_h<H>_w<W> (stitch_vit launched so), stitch_{compile,reduce_overhead}_chunk<N> (N images a compiled call), stitch_compile_mlp<R> (MLPs in R-row chunks), stitch_compile_unfused (the MLPs not one quack GEMM), stitch_compile_qkv[_flash,_efficient] (q, k, v as one GEMM)")
    ap.add_argument("--compile-batches", default="2048", help="batches at which compiled variants run (each "
                                                                "compile costs tens of seconds)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--check-images", type=int, default=64, help="distinct images compared against stock")
    ap.add_argument("--skip-encode", action="store_true")
    ap.add_argument("--skip-prepare", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the prepared directory")
    ap.add_argument("--scratch", default="/tmp/stitch-bench-prepare")
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="prepare_stitch")
    ap.add_argument("--smoke", action="store_true", help="CPU in seconds: 2-layer tower, 48 small JPEGs")
    ap.add_argument("--cpu-pipeline", action="store_true", help="prepare with a null tower (no encoder cost) on "
                                                                "full-size JPEGs; implies --skip-encode")
    ap.add_argument("--project-workers", type=int, default=15, help="--cpu-pipeline: project img/s to this many "
                                                                     "workers")
    ap.add_argument("--pil-resize", action="store_true", help="the workers resize with PIL, as before torch's uint8 "
                    "kernels (ClipGeometry identity clip-uint8-draft/1): the baseline of the shipped geometry")
    ap.add_argument("--serial-copy", action="store_true", help="the encoder copies each batch to the GPU in one "
                    "piece before the tower runs (pipeline_chunk None): the baseline of the side-stream copy")
    ap.add_argument("--profile", action="store_true", help="cProfile prepare's main thread (top 25 by own time)")
    ap.add_argument("--no-slots", action="store_true", help="the workers hand each chunk over as a shared-memory "
                    "segment of its own (prepare before its shared slots): the baseline of the slots")
    ap.add_argument("--shard-writers", type=int, default=None, help="threads writing shard files (default "
                    "stitch.data.prepare.SHARD_WRITERS; 1 before round 20): the baseline of the overlapped writes")
    ap.add_argument("--save-file-writer", action="store_true", help="shards written by safetensors' save_file, "
                    "then read back for their sha256 (before round 20): the baseline of the hashed-in-memory write")
    ap.add_argument("--profile-encode", action="store_true", help="each encode-only variant: one call under "
                    "torch.profiler, device time by kernel")
    ap.add_argument("--prev-encoder", default=None, help="an older stitch_clip/encoder.py, for the _prev variants")
    ap.add_argument("--thread-cpu", action="store_true", help="prepare's CPU seconds per thread of this process "
                    "(/proc, sampled every 50 ms), in thread_cpu_s")
    ap.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval for the run, in "
                    "seconds (Python's default 0.005): a thread that gave the interpreter lock up for a torch op or "
                    "a file read waits up to this long to get it back from a busy one")
    ap.add_argument("--loader-breakdown", action="store_true", help="only time, in this fresh process, each step "
                    "of prepare's encoder loader thread (loader_breakdown), then exit")
    args = ap.parse_args()
    if args.cpu_pipeline:
        args.skip_encode, args.compile = True, "never"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.images, args.unique, args.encode_batch, args.shard_rows = 48, 8, 8, 16
        args.batches, args.iters, args.warmup, args.check_images = "8", 1, 1, 8
        args.variants, args.compile_batches = "stitch_eager,stitch_channels_last", "8"
        args.workers = 2 if args.workers is None else args.workers
    args.batches = [int(b) for b in str(args.batches).split(",")]
    args.compile_batches = [int(b) for b in str(args.compile_batches).split(",")]
    os.environ.setdefault("STITCH_CACHE", str(Path(args.scratch) / "stitch-cache"))  # the built snapshots
    log(f"device {device}; torch {torch.__version__}")
    if args.loader_breakdown:
        _, spec = bench_host(args.smoke)
        steps = loader_breakdown(spec, device, args.encode_batch)
        log(f"loader {steps}")
        write_result(args.name, {"config": vars(args), "loader_seconds": steps}, args.out)
        return
    host, spec = bench_host(args.smoke, null_tower=args.cpu_pipeline)
    if args.pil_resize:  # the forked workers inherit the switch
        import stitch_clip.encoder as clip_encoder

        clip_encoder.TORCH_RESAMPLE.clear()  # every filter through resize_uint8's PIL branch
        clip_encoder.ClipGeometry.identity = "clip-uint8-draft/1"
    import stitch.data.prepare as prepare_module

    if args.no_slots:
        prepare_module.media_slots = lambda *a, **k: None
    if args.shard_writers is not None:
        prepare_module.SHARD_WRITERS = args.shard_writers
    if args.save_file_writer:  # round 19's writer: safetensors' own write, then the file read back
        from stitch.data.feature_cache import save_file_and_hash

        prepare_module.write_tensor_file = save_file_and_hash
    if args.serial_copy:  # for prepare's run; the encode-only variants set it per encoder
        from stitch_clip.encoder import ClipImageEncoder

        ClipImageEncoder.pipeline_chunk = None
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    root = Path(args.scratch) / "data"
    result: dict = {"config": {k: v for k, v in vars(args).items()}}
    result["dataset"] = make_dataset(root, args.images, args.unique, max(1, os.cpu_count() or 1), args.smoke)
    log(f"dataset {result['dataset']}")
    if not args.skip_prepare:
        result["prepare"] = run_prepare(args, host, root, args.images, device)
        profile = result["prepare"].pop("profile_top25", None)
        log(f"prepare {result['prepare']}")
        if profile:
            result["prepare_profile_top25"] = profile
            log("\n".join(profile))
        if args.cpu_pipeline and result["prepare"].get("main_ms_per_row") is not None:
            result["projection"] = project(result["prepare"], args.project_workers)
            log(f"projection {result['projection']}")
    if not args.skip_encode:
        result["encode_only"] = encode_only(args, spec, root, device)
    result["targets"] = {"prepare_images_per_s": 3000, "encode_only_images_per_s": 60000}
    write_result(args.name, result, args.out)


if __name__ == "__main__":
    main()
