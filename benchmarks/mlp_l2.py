"""Whether CLIP's MLP runs faster in row chunks whose [rows, 3,072] intermediate stays in the H200's L2 (issue 14,
point 5: the encode-only target).

Per 2,048 images the tower's MLPs write and read their fc1 -> quick-GELU -> fc2 intermediates through HBM: 11 layers x
[102,400 x 3,072] bf16 written by fc1, read and written by the GELU, read by fc2 (~2.5 GB a layer). In chunks of a
few thousand rows the intermediate (rows x 6 KiB) fits in the 60 MB L2 and the next chunk reuses its buffer, so
those bytes need never reach HBM; the GEMMs get smaller (wave tails) and there are more launches. This times one
layer's MLP, ViT-B/32-shaped, whole against row chunks, compiled as the tower is (``torch.compile``, default mode),
each checked against the whole one, and cuBLAS's two GEMMs alone (the floor of the unfused path).

    PYTHONPATH=/tmp/site:. python3 benchmarks/mlp_l2.py --out $OUT       # H200
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import log, write_result  # noqa: E402


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    return F.linear(quick_gelu(F.linear(x, w1, b1)), w2, b2)


def mlp_rows(rows: int):
    """The MLP over ``rows``-row chunks of its input, concatenated."""
    def run(x, w1, b1, w2, b2):
        return torch.cat([mlp(x[s : s + rows], w1, b1, w2, b2) for s in range(0, x.shape[0], rows)])
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--rows", default="2048,2816,4096,5632,8192,11264,16384,25600")
    ap.add_argument("--reps", type=int, default=400, help="milliseconds do_bench times each")
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="mlp_l2")
    args = ap.parse_args()
    import triton.testing

    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    m, d, f = args.images * 50, 768, 3072
    x = torch.randn(m, d, device=dev, dtype=dt)
    w1 = (torch.randn(f, d, device=dev) / d**0.5).to(dt)
    b1 = (torch.randn(f, device=dev) * 0.1).to(dt)
    w2 = (torch.randn(d, f, device=dev) / f**0.5).to(dt)
    b2 = (torch.randn(d, device=dev) * 0.1).to(dt)
    weights = (w1, b1, w2, b2)
    flop = 2 * m * d * f * 2

    def bench(fn) -> float:
        return float(triton.testing.do_bench(fn, warmup=50, rep=args.reps, return_mode="median"))

    rows: dict = {}
    hidden = F.linear(x, w1, b1)
    act = quick_gelu(hidden)
    floor = bench(lambda: F.linear(x, w1)) + bench(lambda: F.linear(act, w2))
    rows["cublas_two_gemms"] = {"ms": round(floor, 4), "tflops": round(flop / floor / 1e9, 1)}
    rows["gelu_alone_eager"] = {"ms": round(bench(lambda: quick_gelu(hidden)), 4)}
    whole = torch.compile(mlp, dynamic=False)
    reference = whole(x, *weights)
    ms = bench(lambda: whole(x, *weights))
    rows["whole_compiled"] = {"ms": round(ms, 4), "tflops": round(flop / ms / 1e9, 1)}
    for chunk in map(int, args.rows.split(",")):
        fn = torch.compile(mlp_rows(chunk), dynamic=False)
        try:
            got = fn(x, *weights)
            ms = bench(lambda fn=fn: fn(x, *weights))
            rows[f"rows{chunk}_compiled"] = {
                "ms": round(ms, 4), "tflops": round(flop / ms / 1e9, 1),
                "x_whole": round(rows["whole_compiled"]["ms"] / ms, 3),
                "max_abs_diff_vs_whole": (got.float() - reference.float()).abs().max().item(),
                "bitwise_equal_whole": bool(torch.equal(got, reference))}
        except Exception as exc:  # noqa: BLE001 - reported, the next size still runs
            rows[f"rows{chunk}_compiled"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        log(f"mlp rows{chunk}: {rows[f'rows{chunk}_compiled']}")
        torch._dynamo.reset()
    for name, value in rows.items():
        log(f"{name:24s} {value}")
    write_result(args.name, {"images": args.images, "rows": rows,
                             "note": "one ViT-B/32 MLP (fc1 + bias, quick-GELU, fc2 + bias) on images x 50 rows, bf16; "
                                     "do_bench medians (L2 flushed between calls)"}, args.out)


if __name__ == "__main__":
    main()
