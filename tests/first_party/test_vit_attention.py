"""``stitch_vit``, the CLIP tower's attention kernel: the same outputs as sdpa on the projections' strided views,
every launch shape, the same bits for an image whatever it is batched with, and the tower falls back to sdpa where
the kernel cannot run. The kernel's own logic runs on the CPU through Triton's interpreter (fp32: the interpreter's
bf16 dot is wrong, checked on Triton 3.9); its bf16 path runs in the GPU test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("stitch_clip", reason="the CLIP encoder comes from the stitch-clip plugin")


def interpreted(code: str) -> str:
    """Run ``code`` in a fresh Python with Triton's interpreter on (read when Triton is first imported); its stdout."""
    pytest.importorskip("triton", reason="the kernel is Triton's")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


LAUNCH_SHAPES = """
    import json
    import torch
    from stitch_clip import attention

    results = []
    g = torch.Generator().manual_seed(0)
    for batch, heads, tokens, dim, per_program in [(3, 12, 50, 64, 1), (3, 12, 50, 64, 3), (2, 4, 7, 32, 4),
                                                   (2, 2, 64, 16, 2), (2, 12, 50, 64, 12)]:
        attention.LAUNCH["heads"] = per_program
        # the tower's layout: [B, S, H*D] projections viewed as [B, H, S, D]
        q, k, v = (torch.randn(batch, tokens, heads * dim, generator=g).view(batch, tokens, heads, dim)
                   .transpose(1, 2) for _ in range(3))
        scale = dim ** -0.5
        out = attention.vit_attention(q, k, v, scale)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2)
        alone = attention.vit_attention(q[-1:], k[-1:], v[-1:], scale)
        results.append({"shape": list(out.shape), "want": list(want.shape),
                        "contiguous": out.is_contiguous(), "max_diff": (out - want).abs().max().item(),
                        "other_image_diff": (out - want.roll(1, 0)).abs().max().item(),
                        "same_alone": torch.equal(alone, out[-1:])})
    print(json.dumps(results))
"""


def test_the_vit_kernel_gives_sdpa_outputs_on_strided_views_in_every_launch_shape():
    results = json.loads(interpreted(LAUNCH_SHAPES).strip().splitlines()[-1])
    assert len(results) == 5
    for r in results:
        assert r["shape"] == r["want"] and r["contiguous"], r
        assert r["max_diff"] < 1e-5, r  # fp32: the same sums in another order
        assert r["other_image_diff"] > 0.1, r  # another image's output: the comparison can fail
        assert r["same_alone"], r  # the last image alone: the same bits as in its batch


def test_the_vit_kernel_passes_torch_library_checks_for_use_inside_a_compiled_tower():
    """Schema, fake (meta) implementation and dispatch, as ``torch.compile`` uses them; run interpreted."""
    out = interpreted("""
        import torch
        from stitch_clip import attention
        q, k, v = (torch.randn(2, 10, 4 * 32).view(2, 10, 4, 32).transpose(1, 2) for _ in range(3))
        report = torch.library.opcheck(attention.vit_attention, (q, k, v, 0.2))
        assert set(report.values()) == {"SUCCESS"}, report
        print("ok", sorted(report))
    """)
    assert out.startswith("ok"), out


@pytest.fixture(scope="module")
def clip_tiny():
    from stitch.host.host import load_plugins

    return load_plugins().get("encoders", "clip-tiny")


def test_the_clip_tower_runs_stitch_vit_and_off_the_gpu_its_features_are_sdpas(clip_tiny):
    from transformers import CLIPVisionModel

    from stitch_clip.attention import NAME
    from stitch_clip.encoder import drop_unused_layers

    encoder = clip_tiny.load(clip_tiny.source, "cpu", torch.float32)
    assert encoder.model.config._attn_implementation == NAME
    sdpa = drop_unused_layers(CLIPVisionModel.from_pretrained(
        **clip_tiny.source.pretrained_kwargs(), use_safetensors=True, attn_implementation="sdpa")).eval()
    pixels = torch.randint(0, 256, (3, 3, 224, 224), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    got = encoder.encode(pixels)
    with torch.no_grad():
        want = sdpa(pixel_values=encoder.normalise(pixels)).last_hidden_state[:, 1:]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel runs on CUDA tensors only")
def test_the_kernel_is_asked_only_for_calls_it_can_run():
    from stitch_clip.attention import TRITON, kernel_usable

    q = torch.zeros(2, 12, 50, 64, device="cuda", dtype=torch.bfloat16)
    assert kernel_usable(q, q, q, None, 0.0) == TRITON
    assert not kernel_usable(q, q, q, torch.zeros(2, 1, 50, 50, device="cuda"), 0.0)  # a mask
    assert not kernel_usable(q, q, q, None, 0.1)  # dropout
    assert not kernel_usable(q.float(), q.float(), q.float(), None, 0.0)  # fp32
    long = torch.zeros(2, 12, 129, 64, device="cuda", dtype=torch.bfloat16)
    assert not kernel_usable(long, long, long, None, 0.0)  # rows past MAX_TOKENS
    wide = torch.zeros(2, 12, 50, 80, device="cuda", dtype=torch.bfloat16)
    assert not kernel_usable(wide, wide, wide, None, 0.0)  # a head width tl.dot does not tile


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel's bf16 path needs a CUDA device")
def test_on_a_gpu_the_vit_kernel_is_as_close_to_fp32_as_sdpa_and_batch_invariant(clip_tiny):
    pytest.importorskip("triton", reason="the kernel is Triton's")
    from stitch_clip.attention import vit_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, s, d = 700, 12, 50, 64
    q, k, v = (torch.randn(b, s, h * d, generator=g, device="cuda", dtype=torch.bfloat16)
               .view(b, s, h, d).transpose(1, 2) for _ in range(3))
    exact = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double()).transpose(1, 2)
    got = vit_attention(q, k, v, d ** -0.5)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    err, sdpa_err = (got.double() - exact).abs().max().item(), (sdpa.double() - exact).abs().max().item()
    assert err <= 2 * sdpa_err + 1e-3, (err, sdpa_err)
    assert (got.double() - exact.roll(1, 0)).abs().max().item() > 0.1
    for n in (1, 7, 512):  # the first n images alone: the same bits as in the batch of 700
        assert torch.equal(vit_attention(q[:n], k[:n], v[:n], d ** -0.5), got[:n]), n

    encoder = clip_tiny.load(clip_tiny.source, "cuda", torch.bfloat16)
    encoder.compile(256)
    pixels = torch.randint(0, 256, (300, 3, 224, 224), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        features = encoder.encode(pixels).float()
    assert any("vit_attention_kernel" in e.name for e in prof.events()), "the compiled tower did not run the kernel"
    encoder.model.set_attn_implementation("sdpa")
    encoder._tower = torch.compile(encoder._patches, dynamic=False)
    reference = encoder.encode(pixels).float()
    relative = ((features - reference).norm(dim=(1, 2)) / reference.norm(dim=(1, 2))).max().item()
    assert relative <= 1e-2, relative  # bf16 towers: other kernels, the same features
