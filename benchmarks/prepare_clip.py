"""Preparation throughput: CLIP ViT-B/32 features in bf16, encode-only and end to end (issue 7, part 1).

Random-init ``CLIPVisionModel`` with the real ViT-B/32 config (12 layers, 768 wide, 224 px, patch 32; speed does
not depend on the weights' values). Features are stitch's: the penultimate layer's 49 patch tokens
(``stitch_clip.encoder``: ``hidden_states[-2][:, 1:]``).

Encode-only variants, each on the same random bf16 pixel batch (default 1024), baseline = ``eager`` (the
attention implementation the earlier ~30k images/s figure used) measured in the same run:

* ``eager``            transformers eager attention, ``output_hidden_states=True`` (stitch_clip's call)
* ``sdpa``             scaled_dot_product_attention (flash backend for 50 tokens x 64-dim heads)
* ``sdpa_cl``          sdpa + channels_last pixels (only the patch-embedding conv sees it)
* ``sdpa_skip``        sdpa, the 12th layer dropped: its output is never used, so layer 11's output
                       (``last_hidden_state`` of an 11-layer tower) is bit-for-bit the same feature
* ``sdpa_compile``     sdpa + ``torch.compile``
* ``sdpa_skip_compile``  both
Each variant's features are compared with ``eager``'s (max |diff|, cosine) so a fast variant cannot be wrong.

End to end (synthetic PNGs written on the device first, noisy photo-like content): a ``DataLoader`` with worker
processes decodes + preprocesses, the main process encodes and writes a safetensors shard per 1,024 images
(stitch.data.prepare.write_shard, atomic) from a background thread:

* ``e2e_stitch``  workers: stitch_clip's ``decode_image`` + ``CLIPImageProcessor`` (CLIP mean/std, shortest
                  edge 224, centre crop) -> float32 pixels; main: eager encode (stitch's code path today)
* ``e2e_fast``    workers: the same PIL decode, bicubic resize + centre crop to uint8 (what the processor does
                  before rescale/normalize); main: pinned copy, normalize on GPU, best encode variant

Command (on the H200 machine, repo root):

    PYTHONPATH=. python3 benchmarks/prepare_clip.py --out benchmarks/results
    # CPU check in seconds: PYTHONPATH=. python benchmarks/prepare_clip.py --smoke --out /tmp/bench
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import log, now, peak_gib, reset_peak, write_result  # noqa: E402

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def clip_config(smoke: bool):
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=2 if smoke else 12,
        num_attention_heads=12,
        image_size=224,
        patch_size=32,
        projection_dim=512,
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
    )


def build_tower(config, attn: str, device, dtype, skip_last: bool):
    from transformers import CLIPVisionModel

    torch.manual_seed(0)
    model = CLIPVisionModel._from_config(config, attn_implementation=attn)
    if skip_last:  # hidden_states[-2] is the output of layer L-1: layer L's work is thrown away
        encoder = getattr(model, "vision_model", model).encoder  # transformers 5 flattened vision_model away
        encoder.layers = encoder.layers[:-1]
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def make_encode(model, skip_last: bool, compile_: bool, channels_last: bool):
    from stitch_clip.encoder import SELECT_LAYER

    def encode(pixels: torch.Tensor) -> torch.Tensor:
        if channels_last:
            pixels = pixels.contiguous(memory_format=torch.channels_last)
        if skip_last:
            return model(pixel_values=pixels).last_hidden_state[:, 1:]
        out = model(pixel_values=pixels, output_hidden_states=True)
        return out.hidden_states[SELECT_LAYER][:, 1:]

    return torch.compile(encode) if compile_ else encode


VARIANTS = {
    # name: (attn, skip_last, compile, channels_last)
    "eager": ("eager", False, False, False),
    "sdpa": ("sdpa", False, False, False),
    "sdpa_cl": ("sdpa", False, False, True),
    "sdpa_skip": ("sdpa", True, False, False),
    "sdpa_compile": ("sdpa", False, True, False),
    "sdpa_skip_compile": ("sdpa", True, True, False),
}


@torch.no_grad()
def encode_only(args, device, dtype) -> dict:
    config = clip_config(args.smoke)
    torch.manual_seed(1)
    pixels = torch.randn(args.batch, 3, 224, 224, device=device).to(dtype)
    results, reference = {}, None
    for name in args.variants.split(","):
        attn, skip, comp, cl = VARIANTS[name]
        model = build_tower(config, attn, device, dtype, skip)
        encode = make_encode(model, skip, comp, cl)
        t0 = now()
        for _ in range(args.warmup):
            feats = encode(pixels)
        warm_s = now() - t0
        reset_peak()
        t0 = now()
        for _ in range(args.iters):
            feats = encode(pixels)
        dt = now() - t0
        feats = feats.float()
        if reference is None:
            reference = feats
        diff = (feats - reference).abs().max().item()
        cos = torch.nn.functional.cosine_similarity(feats.flatten(1), reference.flatten(1)).min().item()
        results[name] = {
            "images_per_s": round(args.batch * args.iters / dt, 1),
            "ms_per_batch": round(1000 * dt / args.iters, 3),
            "warmup_s": round(warm_s, 2),
            "peak_gib": peak_gib(),
            "max_abs_diff_vs_first": diff,
            "min_cosine_vs_first": round(cos, 6),
            "feature_shape": list(feats.shape[1:]),
        }
        log(f"encode {name:18s} {results[name]['images_per_s']:>10.1f} img/s  diff {diff:.3g} cos {cos:.5f}")
        del model, encode
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    base = results[args.variants.split(",")[0]]["images_per_s"]
    for r in results.values():
        r["ratio_vs_baseline"] = round(r["images_per_s"] / base, 3)
    return results


# -- synthetic PNGs -------------------------------------------------------------------------------------------


def _write_png(job: tuple[int, str, int]) -> int:
    import numpy as np
    from PIL import Image, ImageDraw

    i, folder, smoke = job
    rng = np.random.default_rng(i)
    w, h = (
        (int(rng.integers(96, 160)), int(rng.integers(80, 128)))
        if smoke
        else (int(rng.integers(480, 641)), int(rng.integers(360, 481)))
    )
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack(
        [
            (xx * rng.uniform(0.1, 0.5) + yy * rng.uniform(0.1, 0.5) + rng.uniform(0, 255)) % 256
            for _ in range(3)
        ],
        -1,
    )
    img = Image.fromarray(base.astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(3, 9))):
        x0, y0 = int(rng.integers(0, w - 20)), int(rng.integers(0, h - 20))
        box = (x0, y0, x0 + int(rng.integers(10, w // 2)), y0 + int(rng.integers(10, h // 2)))
        fill = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=fill)
    arr = np.asarray(img).astype(np.int16) + rng.normal(0, 6, (h, w, 3)).astype(np.int16)  # sensor-like noise
    path = os.path.join(folder, f"{i:07d}.png")
    Image.fromarray(arr.clip(0, 255).astype(np.uint8)).save(path)
    return os.path.getsize(path)


def make_pngs(folder: Path, n: int, unique: int, workers: int, smoke: bool) -> dict:
    """``unique`` distinct PNGs, hard-linked up to ``n`` files (encoding noisy PNGs costs ~130 ms each;
    decoding does not care whether two files share bytes)."""
    import multiprocessing as mp
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    unique = min(unique, n)
    t0 = time.perf_counter()
    with mp.get_context("fork").Pool(workers) as pool:
        sizes = pool.map(_write_png, [(i, str(folder), int(smoke)) for i in range(unique)], chunksize=4)
    for i in range(unique, n):
        os.link(folder / f"{i % unique:07d}.png", folder / f"{i:07d}.png")
    return {
        "images": n,
        "unique_images": unique,
        "mean_png_kib": round(sum(sizes) / len(sizes) / 1024, 1),
        "generate_s": round(time.perf_counter() - t0, 1),
    }


# -- end to end -----------------------------------------------------------------------------------------------


class PngDataset(torch.utils.data.Dataset):
    def __init__(self, paths: list[str], mode: str) -> None:
        self.paths, self.mode = paths, mode
        self.processor = None

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        from stitch_clip.encoder import decode_image

        image = decode_image(self.paths[i])
        if self.mode == "processor":
            if self.processor is None:
                from transformers import CLIPImageProcessor

                self.processor = CLIPImageProcessor(
                    size={"shortest_edge": 224},
                    crop_size={"height": 224, "width": 224},
                    image_mean=list(CLIP_MEAN),
                    image_std=list(CLIP_STD),
                )
            return self.processor(images=[image], return_tensors="pt")["pixel_values"][0]
        return resize_crop_uint8(image)


def resize_crop_uint8(image) -> torch.Tensor:
    """CLIP's geometry on uint8: shortest edge -> 224 (bicubic), centre crop 224x224; [3, 224, 224] uint8."""
    import numpy as np
    from PIL import Image

    w, h = image.size  # the processor's rule: short edge -> 224, long edge -> int(224 * long / short)
    nw, nh = (224, int(224 * h / w)) if w <= h else (int(224 * w / h), 224)
    image = image.resize((nw, nh), Image.BICUBIC)
    left, top = (nw - 224) // 2, (nh - 224) // 2
    image = image.crop((left, top, left + 224, top + 224))
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)


def _worker_init(_: int) -> None:
    torch.set_num_threads(1)


class ShardWriter:
    """Writes feature shards from a background thread (stitch.data.prepare.write_shard: temp file + rename)."""

    def __init__(self, folder: Path) -> None:
        try:
            from stitch.data.prepare import write_shard
        except Exception:  # pragma: no cover - stitch.data.prepare's deps missing
            from safetensors.torch import save_file

            def write_shard(path, features, metadata):
                save_file({"features": features.contiguous()}, str(path))

        self.write_shard = write_shard
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.q: queue.Queue = queue.Queue(maxsize=4)
        self.bytes = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            idx, feats = item
            path = self.folder / f"shard-{idx:05d}.safetensors"
            self.write_shard(path, feats, {"bench": "prepare_clip", "items": feats.shape[0]})
            self.bytes += path.stat().st_size

    def put(self, idx: int, feats: torch.Tensor) -> None:
        self.q.put((idx, feats))

    def close(self) -> None:
        self.q.put(None)
        self.thread.join()


def end_to_end(args, device, dtype, paths: list[str], mode: str, variant: str) -> dict:
    import shutil

    attn, skip, comp, cl = VARIANTS[variant]
    model = build_tower(clip_config(args.smoke), attn, device, dtype, skip)
    encode = make_encode(model, skip, comp, cl)
    mean = torch.tensor(CLIP_MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD, device=device).view(1, 3, 1, 1)
    with torch.no_grad():  # compile / warm up before the clock starts
        for _ in range(2):
            encode(torch.randn(args.loader_batch, 3, 224, 224, device=device, dtype=dtype))
    loader = torch.utils.data.DataLoader(
        PngDataset(paths, "processor" if mode == "e2e_stitch" else "uint8"),
        batch_size=args.loader_batch,
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        worker_init_fn=_worker_init,
        prefetch_factor=4 if args.workers else None,
        persistent_workers=False,
    )
    out_dir = Path(args.scratch) / f"features-{mode}"
    shutil.rmtree(out_dir, ignore_errors=True)
    writer = ShardWriter(out_dir)
    pending, pending_n, shard = [], 0, 0
    n_images, t_first = 0, None
    t0 = time.perf_counter()
    with torch.no_grad():
        for batch in loader:
            if t_first is None:
                t_first = time.perf_counter()
                n_first = batch.shape[0]
            x = batch.to(device, non_blocking=True)
            if mode == "e2e_stitch":
                x = x.to(dtype)
            else:
                x = ((x.float() / 255.0 - mean) / std).to(dtype)
            pending.append(encode(x).to("cpu", non_blocking=False))
            pending_n += batch.shape[0]
            n_images += batch.shape[0]
            if pending_n >= args.shard_size:
                writer.put(shard, torch.cat(pending))
                shard, pending, pending_n = shard + 1, [], 0
        if pending:
            writer.put(shard, torch.cat(pending))
            shard += 1
    writer.close()
    total = time.perf_counter() - t0
    steady = time.perf_counter() - t_first
    result = {
        "images": n_images,
        "images_per_s": round(n_images / total, 1),
        "images_per_s_after_first_batch": round((n_images - n_first) / steady, 1),
        "seconds": round(total, 2),
        "first_batch_s": round(t_first - t0, 2),
        "workers": args.workers,
        "loader_batch": args.loader_batch,
        "encode_variant": variant,
        "shards": shard,
        "shard_mib_total": round(writer.bytes / 2**20, 1),
    }
    shutil.rmtree(out_dir, ignore_errors=True)
    return result


def check_fast_pixels(paths: list[str]) -> float:
    """Max |diff| between the processor's pixels and uint8 resize/crop + normalize, on a few images."""
    ds_p, ds_u = PngDataset(paths[:8], "processor"), PngDataset(paths[:8], "uint8")
    mean = torch.tensor(CLIP_MEAN).view(3, 1, 1)
    std = torch.tensor(CLIP_STD).view(3, 1, 1)
    return max(float(((ds_u[i].float() / 255 - mean) / std - ds_p[i]).abs().max()) for i in range(len(ds_p)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1024, help="encode-only batch")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="first one is the baseline")
    ap.add_argument("--images", type=int, default=16384, help="synthetic PNGs for the end-to-end run")
    ap.add_argument("--unique-images", type=int, default=1024, help="distinct PNGs (the rest are hard links)")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--loader-batch", type=int, default=256)
    ap.add_argument("--shard-size", type=int, default=1024)
    ap.add_argument("--e2e-variant", default="sdpa_skip_compile", help="encode variant used by e2e_fast")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--scratch", default="/tmp/stitch-bench-clip")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--name", default="prepare_clip")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run (2-layer tower, few images)")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    if args.smoke:
        args.batch, args.iters, args.warmup, args.images = 8, 2, 1, 24
        args.workers, args.loader_batch, args.shard_size = min(args.workers, 2), 8, 16
        args.variants, args.e2e_variant = "eager,sdpa,sdpa_skip", "sdpa_skip"
    log(f"device {device}; torch {torch.__version__}")

    result: dict = {"config": vars(args), "encode_only": encode_only(args, device, dtype)}
    eo = result["encode_only"]
    best = max(eo, key=lambda k: eo[k]["images_per_s"])
    result["encode_only_best"] = {"variant": best, **eo[best]}
    if not args.skip_e2e:
        folder = Path(args.scratch) / "pngs"
        result["pngs"] = make_pngs(
            folder, args.images, args.unique_images, max(1, os.cpu_count() or 1), args.smoke
        )
        log(f"pngs {result['pngs']}")
        paths = sorted(str(p) for p in folder.glob("*.png"))[: args.images]
        result["fast_pixels_max_abs_diff_vs_processor"] = round(check_fast_pixels(paths), 4)
        from transformers import CLIPImageProcessor

        result["processor_class"] = type(CLIPImageProcessor()).__name__
        e2e = {
            "e2e_stitch": end_to_end(args, device, dtype, paths, "e2e_stitch", "eager"),
            "e2e_fast": end_to_end(args, device, dtype, paths, "e2e_fast", args.e2e_variant),
        }
        e2e["e2e_fast"]["ratio_vs_e2e_stitch"] = round(
            e2e["e2e_fast"]["images_per_s"] / e2e["e2e_stitch"]["images_per_s"], 3
        )
        for k, v in e2e.items():
            log(f"{k}: {v}")
        result["end_to_end"] = e2e
    result["targets"] = {"encode_only_images_per_s": 60000, "end_to_end_images_per_s": 3000}
    write_result(args.name, result, args.out)


if __name__ == "__main__":
    main()
