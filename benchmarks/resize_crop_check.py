"""``ClipDeviceGeometry.resize_crop`` against an earlier encoder.py's: the same pixels bit for bit, and the time.

The device decode path's batched resize + crop of 32 noise images of COCO-like sizes (360-480 x 480-640, a quarter
portrait) on ``--device``, through this checkout's geometry and through the one in ``--old`` (an encoder.py of an
earlier commit, e.g. ``git show 2b80d5b:stitch_clip/encoder.py > .bench-old/encoder_2b80d5b.py``). Prints whether
the uint8 outputs are equal and each one's microseconds an image (5 calls after one untimed).

    PYTHONPATH=. python3 benchmarks/resize_crop_check.py --old .bench-old/encoder_2b80d5b.py --device cuda
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stitch_clip.encoder import ClipDeviceGeometry, ClipGeometry  # noqa: E402


def load_old(path: str):
    spec = importlib.util.spec_from_file_location("encoder_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def noise_images(device: torch.device, count: int = 32) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    sizes = [(int(torch.randint(360, 481, (1,), generator=generator)),
              int(torch.randint(480, 641, (1,), generator=generator))) for _ in range(count * 3 // 4)]
    sizes += [(w, h) for h, w in sizes[: count - len(sizes)]]  # portrait
    return [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=generator).to(device) for h, w in sizes]


def us_per_image(geometry, images: list[torch.Tensor], device: torch.device, calls: int = 5) -> float:
    geometry.resize_crop(images, device)  # the weights cached, the kernels loaded
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(calls):
        geometry.resize_crop(images, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - started) / calls / len(images) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="an earlier stitch_clip/encoder.py")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    old = load_old(args.old)
    new = ClipDeviceGeometry(ClipGeometry(224, (224, 224), 3), decoder_version="check")
    before = old.ClipDeviceGeometry(old.ClipGeometry(224, (224, 224), 3), decoder_version="check")
    images = noise_images(device)
    print("bit-identical:", torch.equal(new.resize_crop(images, device), before.resize_crop(images, device)))
    for name, geometry in (("new", new), ("old", before)):
        print(name, round(us_per_image(geometry, images, device), 1), "us/img")


if __name__ == "__main__":
    main()
