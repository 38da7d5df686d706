"""Encode-only variants of the shipped CLIP ViT-B/32 path, one process, with a profile (issue 14, point 5).

`prepare_stitch.py` times the shipped encoder (`ClipImageEncoder.encode` on a pinned uint8 batch) against stock
transformers. This script asks where the rest of the time goes and what the next levers give, all on the same
random-init clip-vit-base-patch32-shaped tower (12 layers, the 12th dropped as shipped), bf16, batch ``--batch``:

- ``shipped``: ``encode(uint8 on the host)``, as prepare calls it (copy + normalise + tower);
- ``conv_patch``: the shipped path with the stock Conv2d patch embedding instead of its one-GEMM ``PatchGemm``;
- ``on_device``: the same with the uint8 batch already on the GPU (the host-to-device copy's share);
- ``fused_qkv``: q/k/v as one [768 -> 2304] GEMM per layer instead of three [768 -> 768] ones;
- ``pipelined``: fused q/k/v, and the next batch's copy on a side stream while this one encodes;
- ``fp8``: fused q/k/v and every encoder-layer linear in fp8 (e4m3, per-row activation / per-channel
  weight scales, ``torch._scaled_mm``), a precision change, so it is reported, not shipped.

Each name with ``_compile`` appended runs its tower under ``torch.compile`` (as ``data.prepare.compile`` does).
Every variant's features are compared with an fp32 eager run of the same tower on the same images (min cosine,
max relative L2), and with the shipped bf16 path. A torch.profiler table of the top kernels is recorded for the
shipped compiled tower and the fused one.

    PYTHONPATH=. python3 benchmarks/encode_variants.py --out $OUT              # H200
    PYTHONPATH=. python benchmarks/encode_variants.py --smoke --out /tmp/b     # CPU, seconds (fp8 skipped)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import types
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import log, now, peak_gib, profile_once, reset_peak, write_result  # noqa: E402
from benchmarks.prepare_stitch import build_b32_random  # noqa: E402


def fused_qkv_forward(self, hidden_states, attention_mask=None, **kwargs):
    """CLIPAttention.forward with one projection for q, k and v (``self.qkv_proj``, bf16 or fp8)."""
    b, s, _ = hidden_states.shape
    qkv = self.qkv_proj(hidden_states).view(b, s, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)
    out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=attention_mask, scale=self.scale)
    return self.out_proj(out.transpose(1, 2).reshape(b, s, -1)), None


def fuse_qkv(model) -> int:
    from transformers.models.clip.modeling_clip import CLIPAttention

    n = 0
    for m in model.modules():
        if isinstance(m, CLIPAttention):
            w = torch.cat([m.q_proj.weight, m.k_proj.weight, m.v_proj.weight])
            bias = torch.cat([m.q_proj.bias, m.k_proj.bias, m.v_proj.bias])
            m.qkv_proj = torch.nn.Linear(w.shape[1], w.shape[0], device=w.device, dtype=w.dtype)
            with torch.no_grad():
                m.qkv_proj.weight.copy_(w)
                m.qkv_proj.bias.copy_(bias)
            m.forward = types.MethodType(fused_qkv_forward, m)
            n += 1
    return n


class Fp8Linear(torch.nn.Module):
    """y = x W^T + b with x quantised per row and W per output channel to e4m3 (448 = e4m3's largest value)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        scale = weight.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0  # [N, 1]
        self.register_buffer("w", (weight.float() / scale).to(torch.float8_e4m3fn))
        self.register_buffer("w_scale", scale.t().contiguous())  # [1, N]
        self.bias = None if bias is None else bias.detach().to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        x_scale = x2.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0  # [M, 1]
        xq = (x2.float() / x_scale).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(xq, self.w.t(), scale_a=x_scale, scale_b=self.w_scale, bias=self.bias,
                             out_dtype=torch.bfloat16)
        return y.view(*x.shape[:-1], -1)


def to_fp8(model) -> int:
    """Every linear of the encoder layers (fused q/k/v included) in fp8; the patch embedding stays bf16."""
    from transformers.models.clip.modeling_clip import CLIPMLP, CLIPAttention

    n = 0
    for m in model.modules():
        if isinstance(m, CLIPAttention):  # fuse_qkv made its forward read qkv_proj
            m.qkv_proj = Fp8Linear(m.qkv_proj.weight, m.qkv_proj.bias)
            m.out_proj = Fp8Linear(m.out_proj.weight, m.out_proj.bias)
            n += 2
        elif isinstance(m, CLIPMLP):
            m.fc1, m.fc2 = Fp8Linear(m.fc1.weight, m.fc1.bias), Fp8Linear(m.fc2.weight, m.fc2.bias)
            n += 2
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--check", type=int, default=64, help="images compared against the fp32 tower")
    ap.add_argument("--variants", default="shipped,conv_patch,on_device,fused_qkv,pipelined,shipped_compile,fused_qkv_compile,"
                                          "pipelined_compile,fp8_compile")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tag", default="")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if args.smoke:
        args.batch, args.iters, args.warmup, args.check = 16, 2, 1, 8
    from stitch.plugins.specs import ModelSource
    from stitch_clip.encoder import load_clip

    snap = Path(tempfile.mkdtemp(prefix="clip-b32-"))
    build_b32_random(snap, smoke=args.smoke)
    source = ModelSource(local_path=str(snap))
    gen = torch.Generator().manual_seed(0)
    host = torch.randint(0, 256, (args.batch, 3, 224, 224), dtype=torch.uint8, generator=gen)
    host = host.pin_memory() if cuda else host
    on_device = host.to(device)
    check = host[: args.check]

    truth_enc = load_clip(source, device, torch.float32)
    truth = truth_enc.encode(check).float()
    del truth_enc

    def compare(features: torch.Tensor, ref: torch.Tensor) -> dict:
        got = features.float()
        cos = F.cosine_similarity(got.flatten(1), ref.flatten(1)).min().item()
        rel = ((got - ref).norm(dim=(1, 2)) / ref.norm(dim=(1, 2))).max().item()
        return {"min_cosine": round(cos, 6), "max_rel_l2": round(rel, 5)}

    def timed(fn) -> float:
        for _ in range(args.warmup):
            fn()
        torch.cuda.synchronize() if cuda else None
        reset_peak()
        t0 = now()
        for _ in range(args.iters):
            fn()
        torch.cuda.synchronize() if cuda else None
        return args.batch * args.iters / (now() - t0)

    results: dict = {}
    shipped_features = None
    for name in args.variants.split(","):
        if "fp8" in name and not (cuda and torch.cuda.get_device_capability() >= (8, 9)):
            results[name] = {"skipped": "fp8 needs a GPU of capability 8.9 or newer"}
            continue
        enc = load_clip(source, device, torch.bfloat16)
        if name.startswith("conv_patch"):  # the stock Conv2d patch embedding instead of the shipped PatchGemm
            from stitch_clip.encoder import PatchGemm

            for m in enc.model.modules():
                if type(m) is PatchGemm:
                    m.__class__ = torch.nn.Conv2d
        if any(part in name for part in ("fused_qkv", "pipelined", "fp8")):
            fuse_qkv(enc.model)
        if "fp8" in name:
            to_fp8(enc.model)
        if name.endswith("_compile"):
            enc.compile(args.batch)
        source_batch = on_device if name.startswith("on_device") else host
        try:
            if name.startswith("pipelined"):
                side = torch.cuda.Stream() if cuda else None
                state = {"next": host.to(device)}

                def run(enc=enc, side=side, state=state):
                    # encode this batch while the next one's copy runs on a side stream
                    cur = state["next"]
                    if side is not None:
                        torch.cuda.current_stream().wait_stream(side)
                        cur.record_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(side):
                            state["next"] = host.to(device, non_blocking=True)
                    return enc.encode(cur)
            else:
                def run(enc=enc, batch=source_batch):
                    return enc.encode(batch)
            ips = timed(run)
            row = {"images_per_s": round(ips, 1), "peak_gib": peak_gib()}
            feats = enc.encode(check)
            row["vs_fp32_tower"] = compare(feats, truth)
            if name == "shipped":
                shipped_features = feats.float()
            elif shipped_features is not None:
                row["vs_shipped_bf16"] = compare(feats, shipped_features)
            if cuda and name in ("shipped", "shipped_compile", "fused_qkv", "fused_qkv_compile", "fp8_compile"):
                row["profile"] = profile_once(run)
        except Exception as exc:  # a variant that does not build is reported; the others still run
            row = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        results[name] = row
        log(f"{name:20s} {row.get('images_per_s', row.get('error'))}  {row.get('vs_fp32_tower')}")
        del enc
        torch.cuda.empty_cache() if cuda else None
    base = results.get("shipped", {}).get("images_per_s")
    for row in results.values():
        if base and "images_per_s" in row:
            row["ratio_vs_shipped"] = round(row["images_per_s"] / base, 3)
    write_result(f"encode_variants{args.tag}", {"config": vars(args), "variants": results,
                                                "target_images_per_s": 60000}, args.out)


if __name__ == "__main__":
    main()
