"""The CLIP tower's attention alone on the GPU: stitch_vit's Triton kernel (each launch shape) against torch's sdpa
(its pick and each backend) on ViT-B/32's rows, the query/key/value as the tower hands them over (strided
[B, 12, 50, 64] views of [B, 50, 768] projections), output as the tower's output projection reads it ([B, 50, 768]).

For each: milliseconds a call (triton.testing.do_bench, median), the HBM traffic that implies (q, k, v read once, the
output written once), the ratio to sdpa's pick, the largest error against fp64 attention, and whether an image's
output has the same bits alone as in the batch (prepare encodes 1,024 at a time, serving one).

    python3 benchmarks/vit_attention.py --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import log, write_result  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1024,2048")
    ap.add_argument("--heads", default="1,2,3,4,6,12", help="heads per program to try")
    ap.add_argument("--warps", default="4,8", help="warps per program to try")
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="vit_attention")
    args = ap.parse_args()
    import triton

    from stitch_clip import attention

    backends = torch.nn.attention.SDPBackend
    tokens, heads, dim = 50, 12, 64
    scale = dim ** -0.5
    shipped = dict(attention.LAUNCH)
    result: dict = {"shape": {"tokens": tokens, "heads": heads, "dim": dim}, "shipped_launch": shipped, "rows": {}}
    for batch in [int(b) for b in args.batches.split(",")]:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(batch, tokens, heads * dim, generator=g, device="cuda", dtype=torch.bfloat16)
                   .view(batch, tokens, heads, dim).transpose(1, 2) for _ in range(3))
        exact = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double()).transpose(1, 2)
        traffic = 4 * batch * tokens * heads * dim * 2  # bytes: q, k, v in, the output out

        def sdpa(qq, kk, vv, backend=None):
            with torch.nn.attention.sdpa_kernel([backend]) if backend else contextlib.nullcontext():
                out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, scale=scale)
            return out.transpose(1, 2).reshape(qq.shape[0], tokens, heads * dim)  # what the tower does after

        def ours(qq, kk, vv):
            return attention.vit_attention(qq, kk, vv, scale).view(qq.shape[0], tokens, heads * dim)

        candidates = {"sdpa_pick": sdpa}
        for name in ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "FLASH_ATTENTION"):
            backend = getattr(backends, name)
            candidates[f"sdpa_{name.split('_')[0].lower()}"] = lambda a, b, c, k=backend: sdpa(a, b, c, k)
        launches = list(itertools.product([int(h) for h in args.heads.split(",")],
                                          [int(w) for w in args.warps.split(",")]))
        for h, w in launches:
            candidates[f"stitch_vit_h{h}_w{w}"] = (h, w)
        rows: dict = {}
        for name, fn in candidates.items():
            if isinstance(fn, tuple):
                attention.LAUNCH.update(heads=fn[0], num_warps=fn[1])
                fn = ours
            try:
                out = fn(q, k, v)
                ms = triton.testing.do_bench(lambda f=fn, a=q, b=k, c=v: f(a, b, c), warmup=50, rep=300)
                alone = fn(q[:7], k[:7], v[:7])
                rows[name] = {"ms": round(ms, 4), "gb_per_s": round(traffic / ms / 1e6, 1),
                              "max_abs_err_vs_fp64": (out.double().view_as(exact) - exact).abs().max().item(),
                              "same_bits_alone": torch.equal(alone, out[:7])}
            except Exception as exc:  # a backend this build lacks is reported, the others still run
                rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            attention.LAUNCH.update(shipped)
        pick = rows["sdpa_pick"]["ms"]
        for name, row in rows.items():
            if "ms" in row:
                row["x_sdpa_pick"] = round(pick / row["ms"], 3)
            log(f"b{batch} {name:24s} {row}")
        result["rows"][str(batch)] = rows
    write_result(args.name, result, args.out)


if __name__ == "__main__":
    main()
