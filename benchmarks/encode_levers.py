"""Where the last encode and decode levers stand on the H200 (issue 14, point 5), each against what ships, one process:

1. ``fc1``: CLIP's MLP input projection with its bias and quick-GELU, [M, 768] x [768 -> 3072] at M = 1,024 images x
   50 tokens. cuBLAS's GEMM alone (the floor), the shipped path (the GEMM, then inductor's fused bias + quick-GELU
   kernel), inductor's max-autotune (Triton templates with the epilogue fused; persistent TMA templates on), and a
   Triton GEMM of this file with bias + quick-GELU in its epilogue (pointer loads and TMA descriptors, a few Hopper
   configs), each checked against an fp32 reference.
2. ``attention``: sdpa's kernels on ViT-B/32's [1,024, 12, 50, 64] q/k/v laid out as CLIP's projections leave them.
3. ``decode``: JPEG decode + CLIP geometry of COCO-like photos (``prepare_stitch._photo_jpeg``) by a pool of
   processes, as prepare's workers do: the shipped ``ClipGeometry`` (PIL, DCT scale 1/2 at most) against
   libjpeg-turbo's finer DCT scales (simplejpeg, scales in eighths); and torchvision's nvjpeg decode on the GPU
   with the resize there, with its pixels compared to the shipped ones.

    PYTHONPATH=/tmp/site:. python3 benchmarks/encode_levers.py --out $OUT       # H200
"""

from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import log, write_result  # noqa: E402

RESULT: dict = {}


def bench(fn, reps: int = 50) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=reps, return_mode="median"))


# -- 1. fc1 + bias + quick-GELU --------------------------------------------------------------------------------


try:  # the kernels are module-level: a jit function calls another through the module's globals
    import triton
    import triton.language as tl
except ImportError:  # a machine without Triton runs the other parts
    triton = None

if triton is not None:
    @triton.jit
    def tile(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
        """This program's output tile, in groups of GROUP_M tile rows (L2 reuse of the weight's columns)."""
        pid = tl.program_id(0)
        num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
        in_group = GROUP_M * num_n
        first_m = (pid // in_group) * GROUP_M
        size_m = min(num_m - first_m, GROUP_M)
        return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m

    @triton.jit
    def fc1_ptr(a_ptr, w_ptr, bias_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                GROUP_M: tl.constexpr, ACT: tl.constexpr):
        pid_m, pid_n = tile(M, N, BM, BN, GROUP_M)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        a_ptrs = a_ptr + offs_m[:, None] * K + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[None, :] * K + offs_k[:, None]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for _ in range(0, K, BK):
            acc = tl.dot(tl.load(a_ptrs), tl.load(w_ptrs), acc)
            a_ptrs += BK
            w_ptrs += BK
        acc += tl.load(bias_ptr + offs_n).to(tl.float32)[None, :]
        if ACT:
            acc = acc * tl.sigmoid(1.702 * acc)
        tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(c_ptr.dtype.element_ty))

    @triton.jit
    def fc1_tma(a_desc, w_desc, bias_ptr, c_desc, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                GROUP_M: tl.constexpr, ACT: tl.constexpr):
        pid_m, pid_n = tile(M, N, BM, BN, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            a = a_desc.load([pid_m * BM, k])
            w = w_desc.load([pid_n * BN, k])
            acc = tl.dot(a, w.T, acc)
        offs_n = pid_n * BN + tl.arange(0, BN)
        acc += tl.load(bias_ptr + offs_n).to(tl.float32)[None, :]
        if ACT:
            acc = acc * tl.sigmoid(1.702 * acc)
        c_desc.store([pid_m * BM, pid_n * BN], acc.to(tl.bfloat16))


CONFIGS = [  # BM, BN, BK, stages, warps
    (128, 128, 64, 4, 4), (128, 128, 64, 4, 8), (128, 256, 64, 3, 8), (128, 256, 64, 4, 8),
    (256, 128, 64, 3, 8), (256, 128, 64, 4, 8), (128, 256, 64, 3, 4), (128, 192, 64, 4, 8),
]


def run_fc1(args) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    dev = torch.device("cuda")
    M, K, N = args.images * 50, 768, 3072
    flops = 2 * M * K * N
    torch.manual_seed(0)
    a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(N, K, device=dev) / K ** 0.5).to(torch.bfloat16)
    b = (torch.randn(N, device=dev) * 0.1).to(torch.bfloat16)
    ref = F.linear(a.float(), w.float(), b.float())
    ref = ref * torch.sigmoid(1.702 * ref)

    def rel(x):
        return float((x.float() - ref).norm() / ref.norm())

    out: dict = {"M": M, "K": K, "N": N}
    t = bench(lambda: torch.mm(a, w.t()))
    out["cublas_mm_only_ms"] = t
    out["cublas_tflops"] = flops / t / 1e9

    def shipped(x):
        h = F.linear(x, w, b)
        return h * torch.sigmoid(1.702 * h)

    eager_ms = bench(lambda: shipped(a))
    compiled = torch.compile(shipped)
    y = compiled(a)
    out["shipped_eager_ms"], out["shipped_compiled_ms"], out["shipped_rel"] = eager_ms, bench(lambda: compiled(a)), rel(y)
    log(f"fc1: cuBLAS mm {t:.3f} ms ({out['cublas_tflops']:.0f} TFLOP/s); shipped compiled {out['shipped_compiled_ms']:.3f}"
        f" (eager {eager_ms:.3f}) rel {out['shipped_rel']:.2e}")
    try:
        import torch._inductor.config as ic

        torch._dynamo.reset()
        with ic.patch({"triton.enable_persistent_tma_matmul": True, "max_autotune_gemm_backends": "TRITON,ATEN",
                       "epilogue_fusion": True}):
            tuned = torch.compile(shipped, mode="max-autotune-no-cudagraphs")
            y = tuned(a)
        out["max_autotune_ms"], out["max_autotune_rel"] = bench(lambda: tuned(a)), rel(y)
        log(f"fc1: max-autotune (persistent TMA) {out['max_autotune_ms']:.3f} ms rel {out['max_autotune_rel']:.2e}")
    except Exception as exc:  # noqa: BLE001
        out["max_autotune_error"] = repr(exc)[:400]
        log(f"fc1: max-autotune failed {exc!r}"[:300])
    try:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    except Exception:  # noqa: BLE001
        pass
    c = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    rows = []

    def make_call(kind, bm, bn, bk, stages, warps):
        grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
        meta = dict(BM=bm, BN=bn, BK=bk, GROUP_M=8, num_stages=stages, num_warps=warps)
        if kind == "ptr":
            return lambda act=1: fc1_ptr[grid](a, w, b, c, M, N, K, ACT=act, **meta)
        ad, wd, cd = (TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]),
                      TensorDescriptor.from_tensor(c, [bm, bn]))
        return lambda act=1: fc1_tma[grid](ad, wd, b, cd, M, N, K, ACT=act, **meta)

    for bm, bn, bk, stages, warps in CONFIGS:
        for kind in ("ptr", "tma"):
            name = f"{kind} {bm}x{bn}x{bk} s{stages} w{warps}"
            try:
                call = make_call(kind, bm, bn, bk, stages, warps)
                c.fill_(float("nan"))
                call()
                torch.cuda.synchronize()
                err = rel(c)
                ms = bench(call)
                ms_noact = bench(lambda: call(0))  # noqa: B023
                rows.append({"config": name, "ms": ms, "ms_no_act": ms_noact, "rel": err,
                             "tflops": flops / ms / 1e9})
                log(f"fc1 triton {name}: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s), no act {ms_noact:.3f}, rel {err:.2e}")
            except Exception as exc:  # noqa: BLE001
                rows.append({"config": name, "error": repr(exc)[:300]})
                log(f"fc1 triton {name}: failed {exc!r}"[:300])
    out["triton"] = rows
    ok = [r for r in rows if "ms" in r and r["rel"] < 1e-2]
    if ok:
        best = min(ok, key=lambda r: r["ms"])
        out["triton_best"] = best
        log(f"fc1: best fused {best['config']} {best['ms']:.3f} ms against shipped {out['shipped_compiled_ms']:.3f}"
            f" ({out['shipped_compiled_ms'] / best['ms']:.3f}x)")
    RESULT["fc1"] = out


# -- 2. attention kernels -------------------------------------------------------------------------------------


def run_attention(args) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = torch.device("cuda")
    b, s, h, d = args.images, 50, 12, 64
    qkv = [torch.randn(b, s, h * d, device=dev, dtype=torch.bfloat16) for _ in range(3)]
    q, k, v = (x.view(b, s, h, d).transpose(1, 2) for x in qkv)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    out = {}
    for name, backend in (("efficient", SDPBackend.EFFICIENT_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                y = F.scaled_dot_product_attention(q, k, v)
                ms = bench(lambda: F.scaled_dot_product_attention(q, k, v))
            out[name] = {"ms": ms, "rel": float((y.float() - ref).norm() / ref.norm())}
            log(f"attention {name}: {ms:.3f} ms per {b} images, rel {out[name]['rel']:.2e}")
        except Exception as exc:  # noqa: BLE001
            out[name] = {"error": repr(exc)[:300]}
    RESULT["attention"] = out


# -- 3. decode -------------------------------------------------------------------------------------------------


def _make(seed: int) -> bytes:
    from benchmarks.prepare_stitch import _photo_jpeg

    return _photo_jpeg(seed, False)


def sj_geometry(data: bytes) -> torch.Tensor:
    import simplejpeg

    from stitch_clip.encoder import ClipGeometry, resize_uint8

    arr = simplejpeg.decode_jpeg(data, "RGB", min_height=224, min_width=224)
    h, w = arr.shape[:2]
    size, top, left = ClipGeometry(224, (224, 224), 3).placement(w, h)
    pixels = torch.from_numpy(arr).permute(2, 0, 1)
    if size != (w, h):
        pixels = resize_uint8(pixels, size, 3)
    return pixels[:, top : top + 224, left : left + 224].contiguous()


def _work(job):
    kind, datas = job
    torch.set_num_threads(1)
    if kind == "shipped":
        from stitch_clip.encoder import ClipGeometry

        geo = ClipGeometry(224, (224, 224), 3)
    else:
        geo = sj_geometry
    t = time.perf_counter()
    for d in datas:
        geo(d)
    return time.perf_counter() - t


def run_decode(args) -> None:
    ctx = mp.get_context("fork")
    with ctx.Pool(16) as pool:
        unique = pool.map(_make, range(512))
    datas = [unique[i % 512] for i in range(args.decode_images)]
    out: dict = {"images": len(datas), "mean_kib": sum(map(len, unique)) / len(unique) / 1024}
    for kind in ("shipped", "simplejpeg_eighths", "shipped", "simplejpeg_eighths"):
        try:
            with ctx.Pool(args.workers) as pool:
                pool.map(_work, [(kind, datas[:16])] * args.workers)  # warm: imports
                chunk = 64
                jobs = [(kind, datas[i : i + chunk]) for i in range(0, len(datas), chunk)]
                t = time.perf_counter()
                busy = sum(pool.map(_work, jobs))
                wall = time.perf_counter() - t
            out.setdefault(kind, []).append({"images_per_s": len(datas) / wall, "ms_per_image_worker": busy / len(datas) * 1e3})
            log(f"decode {kind}, {args.workers} processes: {len(datas) / wall:.0f} images/s, "
                f"{busy / len(datas) * 1e3:.2f} ms an image a worker")
        except Exception as exc:  # noqa: BLE001
            out[kind + "_error"] = repr(exc)[:300]
            log(f"decode {kind} failed {exc!r}"[:300])
    try:
        import torchvision
        from torchvision.io import decode_jpeg

        from stitch_clip.encoder import ClipGeometry

        out["torchvision"] = torchvision.__version__
        tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]

        def gpu_geometry(images):
            outs = []
            for img in images:
                _, h, w = img.shape
                size = (224, int(224 * h / w)) if w <= h else (int(224 * w / h), 224)
                x = F.interpolate(img[None].float(), size=(size[1], size[0]), mode="bicubic", antialias=True)
                top, left = (size[1] - 224) // 2, (size[0] - 224) // 2
                outs.append(x[0, :, top : top + 224, left : left + 224])
            return torch.stack(outs).round_().clamp_(0, 255).to(torch.uint8)

        for batch in (256, 1024):
            decode_jpeg(tensors[:batch], device="cuda")
            torch.cuda.synchronize()
            t = time.perf_counter()
            for i in range(0, len(tensors), batch):
                decode_jpeg(tensors[i : i + batch], device="cuda")
            torch.cuda.synchronize()
            dec = len(tensors) / (time.perf_counter() - t)
            t = time.perf_counter()
            for i in range(0, len(tensors), batch):
                gpu_geometry(decode_jpeg(tensors[i : i + batch], device="cuda"))
            torch.cuda.synchronize()
            whole = len(tensors) / (time.perf_counter() - t)
            out[f"nvjpeg_batch{batch}"] = {"decode_images_per_s": dec, "decode_resize_images_per_s": whole}
            log(f"nvjpeg batch {batch}: decode {dec:.0f} images/s; decode + resize + crop {whole:.0f} images/s")
        geo = ClipGeometry(224, (224, 224), 3)
        cpu = torch.stack([geo(d) for d in unique[:64]]).float()
        full = torch.stack([torch.from_numpy(__import__("numpy").asarray(
            __import__("PIL.Image", fromlist=["Image"]).open(io.BytesIO(d)).convert("RGB")).copy()).permute(2, 0, 1)
            for d in unique[:64]][:1])
        del full
        gpu = gpu_geometry(decode_jpeg([torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in unique[:64]],
                                       device="cuda")).float().cpu()
        sj = torch.stack([sj_geometry(d) for d in unique[:64]]).float()
        for name, x in (("nvjpeg_gpu_resize", gpu), ("simplejpeg_eighths", sj)):
            diff = (x - cpu).abs()
            out[f"pixels_{name}_vs_shipped"] = {"mean_abs": float(diff.mean()), "frac_gt_2": float((diff > 2).float().mean()),
                                                "frac_gt_10": float((diff > 10).float().mean())}
            log(f"pixels {name} vs shipped: mean |diff| {float(diff.mean()):.3f}, > 2 levels {float((diff > 2).float().mean()):.4f}")
    except Exception as exc:  # noqa: BLE001
        out["nvjpeg_error"] = repr(exc)[:400]
        log(f"nvjpeg failed: {exc!r}"[:400])
        traceback.print_exc()
    RESULT["decode"] = out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=1024, help="images a GEMM / attention call covers (x 50 tokens)")
    ap.add_argument("--decode-images", type=int, default=8192)
    ap.add_argument("--workers", type=int, default=15)
    ap.add_argument("--parts", default="decode,attention,fc1")
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--name", default="encode_levers")
    args = ap.parse_args()
    RESULT.update({"cpu_count": os.cpu_count()})
    for part in args.parts.split(","):
        try:
            {"fc1": run_fc1, "attention": run_attention, "decode": run_decode}[part](args)
        except Exception as exc:  # noqa: BLE001
            RESULT[part + "_error"] = repr(exc)[:400]
            traceback.print_exc()
        write_result(args.name, RESULT, args.out)


if __name__ == "__main__":
    main()
