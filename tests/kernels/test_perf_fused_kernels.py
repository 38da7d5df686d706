"""stitch_qwen's fused kernels (liger-kernel RMSNorm / SwiGLU / RoPE) replace every norm, MLP and RoPE call of the
loaded model with the kernel call whose arguments reproduce transformers' math, leave CPU tensors on transformers'
own code, and are installed by the model binding at load. Off a GPU liger's Triton kernels cannot run, so the wiring
is checked with PyTorch stand-ins of the kernels' documented semantics; the GPU test runs the real kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stitch_qwen import kernels

CALLS: list[str] = []


def reference_rms_norm(x, weight, eps, offset, casting_mode, in_place):
    """liger's rms_norm: 'llama' scales x in fp32 and casts before the weight; 'gemma' does everything in fp32."""
    CALLS.append(f"rms_norm:{offset}:{casting_mode}")
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if casting_mode == "llama":
        return (offset + weight) * normed.to(x.dtype)
    return (normed * (offset + weight.float())).to(x.dtype)


def reference_swiglu(a, b):
    CALLS.append("swiglu")
    return F.silu(a) * b


def reference_rope(q, k, cos, sin, unsqueeze_dim=1):
    CALLS.append("rope")
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def rotate(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


STAND_INS = {"rms_norm": reference_rms_norm, "swiglu": reference_swiglu, "rope": reference_rope}


def tiny(kind: str, dtype=torch.float32, device="cpu"):
    import transformers

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True)
    if kind == "qwen3":
        cfg, cls = transformers.Qwen3Config(**common), transformers.Qwen3ForCausalLM
    else:
        cfg = transformers.Qwen3_5TextConfig(**common, layer_types=["full_attention"] * 2)
        cls = transformers.Qwen3_5ForCausalLM
    torch.manual_seed(0)
    model = cls._from_config(cfg, dtype=dtype, attn_implementation="sdpa").to(device)
    with torch.no_grad():  # norms away from their init (ones / zeros), so a wrong offset shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def stand_ins(monkeypatch):
    """liger's functions replaced by PyTorch stand-ins, and 'on a GPU' forced for CPU tensors."""
    monkeypatch.setattr(kernels, "liger_functions", lambda: STAND_INS)
    monkeypatch.setattr(kernels, "fused_here", lambda t: True)
    CALLS.clear()
    yield CALLS
    kernels.unpatch_fused_rope()


@pytest.mark.parametrize("kind,offset,casting", [("qwen3", 0.0, "llama"), ("qwen3_5", 1.0, "gemma")])
def test_fused_kernels_give_transformers_loss_and_gradients_through_every_norm_mlp_and_rope(kind, offset, casting,
                                                                                           stand_ins):
    model = tiny(kind)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grads = loss_and_grads(model, ids)
    counts = kernels.use_fused_kernels(model)
    layers = model.config.num_hidden_layers
    assert counts["rms_norm"] == 4 * layers + 1 and counts["swiglu"] == layers  # in/post norms, q/k norms, final
    stand_ins.clear()
    loss, grads = loss_and_grads(model, ids)
    assert stand_ins.count(f"rms_norm:{offset}:{casting}") == 4 * layers + 1
    assert stand_ins.count("swiglu") == layers
    assert stand_ins.count("rope") == (layers if kind == "qwen3" else 0)  # Qwen3.5's partial mrope keeps its own
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert torch.allclose(g, ref_grads[name], rtol=1e-5, atol=1e-6), name


def test_off_a_gpu_the_switched_modules_run_transformers_own_code(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a kernel was called for a CPU tensor")

    monkeypatch.setattr(kernels, "liger_functions", lambda: dict.fromkeys(STAND_INS, refuse))
    model = tiny("qwen3")
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(2))
    ref_loss, _ = loss_and_grads(model, ids)
    try:
        assert kernels.use_fused_kernels(model)["rms_norm"] > 0
        loss, _ = loss_and_grads(model, ids)
    finally:
        kernels.unpatch_fused_rope()
    assert torch.equal(loss, ref_loss)


def test_restore_gives_back_transformers_classes_and_rope(stand_ins):
    import transformers.models.qwen3.modeling_qwen3 as qwen3

    original_rope = qwen3.apply_rotary_pos_emb
    model = tiny("qwen3")
    before = [type(m) for m in model.modules()]
    kernels.use_fused_kernels(model)
    kernels.use_fused_kernels(model)  # idempotent: one switch, one wrap
    assert qwen3.apply_rotary_pos_emb.stitch_original is original_rope
    kernels.restore_reference_kernels(model)
    assert [type(m) for m in model.modules()] == before
    assert qwen3.apply_rotary_pos_emb is original_rope


def test_without_liger_nothing_is_switched(monkeypatch):
    monkeypatch.setattr(kernels, "liger_functions", lambda: None)
    monkeypatch.setattr(kernels, "fla_gdn_functions", lambda: None)  # nor fla (its Gated DeltaNet path)
    model = tiny("qwen3_5")
    before = [type(m) for m in model.modules()]
    assert kernels.use_fused_kernels(model) == {}
    assert [type(m) for m in model.modules()] == before


def test_the_qwen_bindings_install_the_fused_kernels_at_load(monkeypatch):
    from stitch.host.host import load_plugins

    seen = []
    monkeypatch.setattr("stitch_qwen.models.use_fused_kernels", lambda model: seen.append(model) or {})
    monkeypatch.setattr("stitch_qwen.kernels.use_fused_kernels", lambda model: seen.append(model) or {})
    host = load_plugins()
    for name in ("qwen3.5-demo", "qwen3.5-tiny", "qwen3.5-4b"):
        spec = host.get("models", name)
        marker = object()
        spec.install_sample_starts(marker)
        assert seen[-1] is marker, name


@pytest.mark.skipif(not torch.cuda.is_available() or kernels.liger_functions() is None,
                    reason="liger-kernel's Triton kernels need a GPU")
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_liger_kernels_match_transformers_loss_and_gradients_on_a_gpu(kind):
    model = tiny(kind, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, 96, (4, 256), generator=torch.Generator().manual_seed(3)).cuda()
    ref_loss, ref_grads = loss_and_grads(model, ids)
    try:
        counts = kernels.use_fused_kernels(model)
        assert counts["rms_norm"] and counts["swiglu"]
        loss, grads = loss_and_grads(model, ids)
    finally:
        kernels.restore_reference_kernels(model)
    assert abs(float(loss) - float(ref_loss)) <= 1e-2 * abs(float(ref_loss))
    for name, g in grads.items():
        ref = ref_grads[name].float()
        rel = (g.float() - ref).norm() / ref.norm().clamp(min=1e-12)
        assert rel < 3e-2, (name, float(rel))
