"""Where the device path's input time goes: ``ClipDeviceGeometry.device_batch`` taken apart on COCO-like JPEGs.

prepare's encode thread spends most of its time making inputs on the device path (``encode_seconds["inputs"]``,
~210 us an image at steady state on the H200 in round 16, against ~5,000 images/s of nvjpeg + resize measured
alone in round 14). This script times, on ``--images`` JPEGs of prepare_stitch.py's kind, in batches of
``--batch`` (prepare's ``encode_batch_size``), each after one untimed pass:

- the parts one at a time: reading the files, nvjpeg's ``decode_jpeg`` (its call returns once decoded), the
  resize + crop (host time, then the device's);
- the whole ``device_batch`` as shipped, alone and beside a Python thread that holds the interpreter lock as
  prepare's main thread does while it gathers rows (``--busy``);
- the geometry of an earlier encoder.py (``--old``, e.g. round 16's: one indexed copy into the padded input and
  two weight lookups an image), and variants of this script's own (not shipped): larger nvjpeg chunks, each file
  read by one torch op, and the shipped geometry without its decode thread (``serial``);
- the shipped geometry on items whose bytes are views of prepare's shared slot (``in_slot``: what a decode worker's
  ``hand_over`` sends since round 19), against items naming their files (``shipped``);
- each variant's pixels against the shipped ones: equal bit for bit, or the share that differs and by how much
  (an older geometry's identity may differ: round 18's closed-form weights moved a few pixels by a level).

Per-thread CPU seconds (from /proc) of the decode-only loop say whether nvjpeg's own threads spin.

    PYTHONPATH=. python3 benchmarks/device_inputs_check.py --out $OUT      # H200
    PYTHONPATH=. python benchmarks/device_inputs_check.py --smoke --out /tmp/b  # CPU: the variants' pixels only
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import log, now, sync, write_result  # noqa: E402
from benchmarks.prepare_stitch import make_dataset, thread_cpu_now  # noqa: E402
from stitch_clip.encoder import ClipDeviceGeometry, ClipGeometry, JpegItem  # noqa: E402


class Serial(ClipDeviceGeometry):
    """The shipped geometry with round 16's loop: each chunk read and decoded on the calling thread, then resized."""

    def device_batch(self, items: list[Any], device: str | torch.device) -> torch.Tensor:
        device = torch.device(device)
        self.check_decoder(device)
        out = torch.empty((len(items), 3, *self.cpu.crop), dtype=torch.uint8, device=device)
        for at in self.chunks(items, [i for i, item in enumerate(items) if isinstance(item, JpegItem)]):
            out[at] = self.finish(items, at, device)
        return out


def pil_decode(datas: list[bytearray], device: torch.device) -> list[torch.Tensor]:
    """nvjpeg's output made by PIL (``--smoke`` on a CPU machine without torchvision): uint8 [3, h, w]."""
    import io

    import numpy as np
    from PIL import Image

    return [torch.from_numpy(np.asarray(Image.open(io.BytesIO(bytes(d))).convert("RGB")).copy()).permute(2, 0, 1)
            .to(device) for d in datas]


class ReadFile(ClipDeviceGeometry):
    """The shipped geometry, each file read by one torch op (``torchvision.io.read_file``: one release of the interpreter
    lock an image, where Python's open, fstat, readinto and close release it four times)."""

    def decode_jpegs(self, datas: list[Any], device: torch.device) -> list[torch.Tensor]:
        from torchvision.io import ImageReadMode, decode_jpeg

        tensors = [d if isinstance(d, torch.Tensor) else torch.frombuffer(d, dtype=torch.uint8) for d in datas]
        return decode_jpeg(tensors, mode=ImageReadMode.RGB, device=device)

    def decode_chunk(self, items: list[Any], at: list[int], device: torch.device,
                     stream: torch.cuda.Stream | None = None) -> list[torch.Tensor]:
        from torchvision.io import read_file

        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            return self.decode_jpegs([read_file(items[i].data) for i in at], device)


class Busy:
    """A thread running pure Python ``duty`` of the time (it holds the interpreter lock then, except at the switch
    interval), sleeping the rest, in 3 ms periods: prepare's main thread gathering rows between waits."""

    def __init__(self, duty: float = 1.0, switch_interval: float | None = None) -> None:
        self.duty, self.switch_interval = duty, switch_interval

    def __enter__(self) -> Busy:
        self.interval = sys.getswitchinterval()
        if self.switch_interval is not None:
            sys.setswitchinterval(self.switch_interval)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.spin, name="bench-busy", daemon=True)
        self.thread.start()
        return self

    def spin(self) -> None:
        while not self.stop.is_set():
            until = time.perf_counter() + 0.003 * self.duty
            while time.perf_counter() < until:
                sum(range(200))
            if self.duty < 1:
                time.sleep(0.003 * (1 - self.duty))

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()
        sys.setswitchinterval(self.interval)


def timed(fn: Any, repeats: int) -> float:
    fn()
    sync()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - started) / repeats


class PhotoWarmUp(ClipDeviceGeometry):
    """The shipped warm-up, then one chunk of ``DEVICE_CHUNK`` photo-sized JPEGs (640 x 480) decoded and resized:
    nvjpeg's batch buffers, the allocator's blocks and the batched GEMMs at a real chunk's size."""

    def warm_up(self, device: str | torch.device) -> None:
        import io

        import numpy as np
        from PIL import Image

        super().warm_up(device)
        device = torch.device(device)
        noise = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(noise).save(buf, "JPEG", quality=90)
        self.resize_crop(self.decode_jpegs([bytearray(buf.getvalue())] * self.DEVICE_CHUNK, device), device)
        sync()


def cold(args: argparse.Namespace, device: torch.device, items: list[Any]) -> dict[str, Any]:
    """In this fresh process: the warm-up ``args.cold`` names, then the first device_batch calls, each timed."""
    geometry = (PhotoWarmUp if args.cold == "photo" else ClipDeviceGeometry)(ClipGeometry(224, (224, 224), 3),
                                                                               decoder_version="check")
    if device.type != "cuda":
        geometry.decode_jpegs = pil_decode
    started = time.perf_counter()
    geometry.warm_up(device)
    sync()
    out: dict[str, Any] = {"warm_up_s": round(time.perf_counter() - started, 3), "batches_s": []}
    for s in range(0, min(len(items), 6 * args.batch), args.batch):
        profile = None
        if args.profile and s == 0:
            import cProfile

            profile = cProfile.Profile()
            profile.enable()
        began = time.perf_counter()
        geometry.device_batch(items[s : s + args.batch], device)
        sync()
        out["batches_s"].append(round(time.perf_counter() - began, 3))
        if profile is not None:
            profile.disable()
            import io
            import pstats

            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(30)
            out["first_batch_profile"] = [line for line in text.getvalue().splitlines() if line.strip()][-32:]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--old", default=None, help="an earlier stitch_clip/encoder.py, whose geometry runs as 'old'")
    ap.add_argument("--out", default=None)
    ap.add_argument("--root", default="/tmp/stitch-device-inputs")
    ap.add_argument("--profile", action="store_true", help="--cold: the first device_batch under cProfile (its "
                    "calling thread; the decode thread's time shows as the wait for its future)")
    ap.add_argument("--cold", choices=["shipped", "photo"], default=None, help="only time, in this fresh process, "
                    "the given warm-up and then the first six device_batch calls")
    args = ap.parse_args()
    if args.smoke:
        args.images, args.batch, args.repeats = 64, 32, 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    old = None
    if args.old:
        import importlib.util

        spec = importlib.util.spec_from_file_location("encoder_before", args.old)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    root = Path(args.root)
    dataset = make_dataset(root, args.images, min(512, args.images), max(1, (os.cpu_count() or 2) - 1), args.smoke)
    log(f"dataset {dataset}")
    cpu = ClipGeometry(224, (224, 224), 3)
    shipped = ClipDeviceGeometry(cpu, decoder_version="check")
    items = [shipped(str(p)) for p in sorted((root / "imgs").glob("*.jpg"))]
    assert all(isinstance(i, JpegItem) for i in items)
    if args.cold:
        result = {"cold": args.cold, **cold(args, device, items)}
        for line in result.pop("first_batch_profile", []):
            log(line)
        log(f"cold {result}")
        if args.out:
            write_result(f"device_inputs_cold_{args.cold}", {"utc": now(), "command": " ".join(sys.argv), **result},
                         args.out)
        return
    batches = [items[s : s + args.batch] for s in range(0, len(items), args.batch)]
    n = len(items)
    result: dict[str, Any] = {"images": n, "batch": args.batch, "dataset": dataset, "device": str(device),
                              "us_per_image": {}, "pixels_vs_shipped": {}}
    us = result["us_per_image"]

    if device.type == "cuda":
        shipped.warm_up(device)
        per_chunk = [shipped.chunks(b, list(range(len(b)))) for b in batches]
        def read_all() -> list[list[list[bytearray]]]:
            return [[[b[i].read() for i in at] for at in c] for b, c in zip(batches, per_chunk, strict=True)]

        reads = read_all()
        us["read"] = timed(read_all, args.repeats) / n * 1e6
        decoded = [[shipped.decode_jpegs(d, device) for d in r] for r in reads]
        before = {tid: cpu for tid, (_, cpu) in thread_cpu_now().items()}
        us["decode"] = timed(lambda: [[shipped.decode_jpegs(d, device) for d in r] for r in reads],
                             args.repeats) / n * 1e6
        after = {tid: cpu for tid, (_, cpu) in thread_cpu_now().items()}
        python_threads = {t.native_id for t in threading.enumerate()}
        me = threading.get_native_id()
        result["decode_loop_cpu_s"] = {
            "this_thread": round(after.get(me, 0) - before.get(me, 0), 3),
            "other_threads": round(sum(v - before.get(t, 0) for t, v in after.items() if t not in python_threads),
                                   3),
            "decode_loop_wall_s": round(us["decode"] * n / 1e6 * (args.repeats + 1), 3)}
        started = time.perf_counter()
        for r in decoded:
            for images in r:
                shipped.resize_crop(images, device)
        us["resize_host"] = (time.perf_counter() - started) / n * 1e6
        sync()
        us["resize_with_device"] = (time.perf_counter() - started) / n * 1e6
        if old is not None:
            before_geometry = old.ClipDeviceGeometry(old.ClipGeometry(224, (224, 224), 3), decoder_version="check")
            before_geometry.warm_up(device)
            us["resize_old_host"] = timed(lambda: [[before_geometry.resize_crop(im, device) for im in r]
                                                   for r in decoded], args.repeats) / n * 1e6
        del decoded, reads

    variants: dict[str, Any] = {"shipped": shipped, "serial": Serial(cpu, decoder_version="check")}
    if old is not None:
        variants["old"] = old.ClipDeviceGeometry(old.ClipGeometry(224, (224, 224), 3), decoder_version="check")
    big = ClipDeviceGeometry(cpu, decoder_version="check")
    big.DEVICE_CHUNK, big.PIXEL_BUDGET = 1024, 1024 * 640 * 640
    variants["chunk1024"] = big
    if device.type == "cuda":
        variants["readfile"] = ReadFile(cpu, decoder_version="check")
    # the shipped geometry on items whose bytes a decode worker put into prepare's shared slot (round 19): their
    # data is a view of the ring, nothing to read (written here by this process, through the same SlotWriter)
    from stitch.data.shared_slots import SharedSlots

    ring = SharedSlots(1, sum(os.path.getsize(i.data) + 64 for i in items))
    writer = ring.writer(ring.acquire())
    sent = shipped.hand_over(items, writer.put)
    in_slot = shipped.take_over(sent, ring.take_payloads(writer.ref()))
    variants["in_slot"] = shipped
    if device.type != "cuda":
        for geometry in variants.values():
            geometry.decode_jpegs = pil_decode
    reference = [shipped.device_batch(b, device) for b in batches]
    own = batches
    for name, geometry in variants.items():
        # the old module's JpegItem is a class of its own: its geometry takes only those
        batches = [[old.JpegItem(*i) for i in b] for b in own] if name == "old" else own
        if name == "in_slot":
            batches = [in_slot[s : s + args.batch] for s in range(0, n, args.batch)]
        geometry.warm_up(device)
        diffs = [(geometry.device_batch(b, device).int() - ref.int()).abs() for b, ref in
                 zip(batches, reference, strict=True)]
        result["pixels_vs_shipped"][name] = {
            "equal": all(not d.any() for d in diffs), "max_diff": max(int(d.max()) for d in diffs),
            "differing_share": sum(int((d > 0).sum()) for d in diffs) / sum(d.numel() for d in diffs)}
        us[f"device_batch_{name}"] = timed(lambda g=geometry, a=batches: [g.device_batch(b, device) for b in a],
                                           args.repeats) / n * 1e6
        # beside a thread busy a third of the time (prepare's main thread's share in round 16), with the default
        # switch interval (5 ms) and with 0.5 ms; the first two batches, once
        few = batches[:2]
        for label, busy in (("busy30", Busy(0.3)), ("busy30_si05", Busy(0.3, 5e-4)),
                            ("busy100_si05", Busy(1.0, 5e-4))):
            with busy:
                us[f"device_batch_{name}_{label}"] = timed(
                    lambda g=geometry, f=few: [g.device_batch(b, device) for b in f], 1) / sum(map(len, few)) * 1e6
    result["images_per_s"] = {k: round(1e6 / v) for k, v in us.items()}
    result["us_per_image"] = {k: round(v, 1) for k, v in us.items()}
    for key, value in result.items():
        log(f"{key}: {value}")
    if args.out:
        write_result("device_inputs_check", {"utc": now(), "command": " ".join(sys.argv), **result}, args.out)


if __name__ == "__main__":
    main()
