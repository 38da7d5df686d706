"""stitch_qwen runs Qwen3.5's Gated DeltaNet as fla's kernels take it on a GPU: the key heads as they are (fla's GVA),
the decay and beta inside the chunk kernel, and fla's one-kernel gated RMSNorm. It must be the same layer as
transformers' forward, packed (sample starts) and padded, and must leave CPU tensors and cached decoding to
transformers. Off a GPU fla's Triton kernels cannot run, so the wiring is checked against PyTorch stand-ins of fla's
documented semantics (written with transformers' own rule); the GPU test runs the real kernels at the 4B shape."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stitch.kernels.varlen import reference_conv, segments, varlen_kernels_ready
from stitch_qwen import kernels

CALLS: list[str] = []


def torch_rule():
    import transformers.models.qwen3_5.modeling_qwen3_5 as qwen35

    rule = qwen35.torch_chunk_gated_delta_rule
    return getattr(rule, "stitch_original", rule)


def gva_rule(q, k, v, g, beta, *, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
             use_beta_sigmoid_in_kernel, cu_seqlens=None, cu_seqlens_cpu=None):
    """fla 0.6.0's chunk_gated_delta_rule contract: value head j reads key head j // (HV / H); with the gate in the
    kernel g is the raw input of -exp(A_log) * softplus(g + dt_bias); with the beta sigmoid in the kernel beta is
    the raw logit."""
    CALLS.append("rule")
    assert use_qk_l2norm_in_kernel and use_gate_in_kernel and use_beta_sigmoid_in_kernel
    ratio = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(ratio, 2), k.repeat_interleave(ratio, 2)
    g = -A_log.float().exp() * F.softplus(g.float() + dt_bias)
    beta = beta.sigmoid()
    rule = torch_rule()
    if cu_seqlens is None:
        return rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=True)
    assert cu_seqlens.dtype == torch.int64 and cu_seqlens_cpu.tolist() == cu_seqlens.tolist()
    parts = [rule(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e], initial_state=None,
                  output_final_state=False, use_qk_l2norm_in_kernel=True)[0]
             for s, e in segments(q.shape[1], cu_seqlens)]
    return torch.cat(parts, dim=1), None


def gated_norm(x, g, weight, bias, activation="swish", eps=1e-6):
    """fla's rms_norm_gated: normalised in fp32, times the weight, times silu(gate), cast once."""
    CALLS.append(f"norm:{activation}:{eps}")
    assert bias is None and activation in ("silu", "swish")
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * F.silu(g.float())).to(x.dtype)


def conv(x, weight, bias, activation, cu_seqlens):
    CALLS.append("conv" if cu_seqlens is None else "conv:varlen")
    return reference_conv(x, weight, bias, activation, cu_seqlens)


STAND_INS = {"rule": gva_rule, "norm": gated_norm, "conv": conv}
# the CPU references run transformers' own layer on CPU tensors, which it sends to fla's Triton kernels where fla is
# installed (the GPU machines)
TRANSFORMERS_TORCH_RULE = pytest.mark.skipif(kernels.fla_gdn_functions() is not None,
                                             reason="fla is installed: transformers' layer would call it on CPU tensors")


def tiny_hybrid():
    """Qwen3.5 with one Gated DeltaNet (2 key heads, 4 value heads: GVA) and one attention layer, fp32."""
    import transformers

    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True,
        layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM._from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():  # away from the init (ones, zeros), so a dropped weight, bias or offset shows
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name or "A_log" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def loss_and_grads(model, **batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def packed_batch():
    lengths = [7, 11, 6]
    ids = torch.randint(1, 96, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return {"input_ids": ids, "position_ids": positions, "labels": ids}


def padded_batch():
    ids = torch.randint(1, 96, (2, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # a left-padded row: the layer must zero its padding states (they precede the text)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@pytest.fixture
def stand_ins(monkeypatch):
    """fla's functions replaced by PyTorch stand-ins (a test forces 'on fla' for CPU tensors once its reference
    ran: stitch's conv and rule wrappers would take fla's kernels too)."""
    monkeypatch.setattr(kernels, "fla_gdn_functions", lambda: STAND_INS)
    monkeypatch.setattr(kernels, "liger_functions", lambda: None)
    CALLS.clear()
    return CALLS


@TRANSFORMERS_TORCH_RULE
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_the_fla_gated_deltanet_gives_transformers_loss_and_gradients_packed_and_padded(layout, stand_ins,
                                                                                        monkeypatch):
    model = tiny_hybrid()
    kernels.use_varlen(model)  # stitch's packed calls: rows flattened, the starts handed to conv and rule
    batch = packed_batch() if layout == "packed" else padded_batch()
    ref_loss, ref_grads = loss_and_grads(model, **batch)
    assert kernels.use_fused_kernels(model)["gated_deltanet"] == 1
    monkeypatch.setattr(kernels, "_on_fla", lambda t: True)
    stand_ins.clear()
    loss, grads = loss_and_grads(model, **batch)
    varlen = layout == "packed"
    assert stand_ins == ["conv:varlen" if varlen else "conv", "rule", "norm:silu:1e-06"]
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0)
    assert grads.keys() == ref_grads.keys() and any("in_proj_a" in n for n in grads)
    for name, g in grads.items():
        assert torch.allclose(g, ref_grads[name], rtol=1e-4, atol=1e-6), name


@TRANSFORMERS_TORCH_RULE
def test_with_lora_on_its_projections_the_fla_layer_groups_them_and_keeps_loss_and_adapter_gradients(stand_ins,
                                                                                                     monkeypatch):
    """The shipped Qwen3.5 LoRA targets every Gated DeltaNet projection: through the fused layer its four input
    projections run as one SharedInputLoRA node, with transformers' loss and every adapter's gradient."""
    from peft import LoraConfig, get_peft_model

    from stitch.kernels import precision

    model = tiny_hybrid()
    model.requires_grad_(False)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"]))
    precision.lora_in_half_compute(model)
    kernels.use_varlen(model.base_model.model)
    batch = packed_batch()
    ref_loss, ref_grads = loss_and_grads(model, **batch)
    assert kernels.use_fused_kernels(model)["gated_deltanet"] == 1
    monkeypatch.setattr(kernels, "_on_fla", lambda t: True)
    grouped = []
    node = precision.SharedInputLoRA.apply
    monkeypatch.setattr(precision.SharedInputLoRA, "apply", lambda *a: grouped.append(len(a[1])) or node(*a))
    loss, grads = loss_and_grads(model, **batch)
    assert grouped == [4]  # the one Gated DeltaNet's in_proj_qkv / z / b / a
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0)
    assert grads.keys() == ref_grads.keys() and sum("lora_" in n for n in grads) == 18
    for name, g in grads.items():  # fp32, the products summed in another order
        assert (g - ref_grads[name]).norm() <= 1e-5 * ref_grads[name].norm(), name


@TRANSFORMERS_TORCH_RULE
def test_cpu_tensors_and_decoding_with_a_cache_run_transformers_forward(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("an fla kernel was called where transformers' forward belongs")

    monkeypatch.setattr(kernels, "fla_gdn_functions", lambda: dict.fromkeys(STAND_INS, refuse))
    model = tiny_hybrid()
    ids = packed_batch()["input_ids"]
    ref_loss, _ = loss_and_grads(model, input_ids=ids, labels=ids)
    ref_tokens = model.generate(ids[:, :5], max_new_tokens=4, do_sample=False)
    assert kernels.use_fused_kernels(model)["gated_deltanet"] == 1
    loss, _ = loss_and_grads(model, input_ids=ids, labels=ids)  # CPU tensors
    assert torch.equal(loss, ref_loss)
    monkeypatch.setattr(kernels, "_on_fla", lambda t: True)  # on fla, but a cache: prefill and decode stay stock
    assert torch.equal(model.generate(ids[:, :5], max_new_tokens=4, do_sample=False), ref_tokens)


def test_restoring_the_gated_deltanet_alone_keeps_the_other_fused_modules(stand_ins, monkeypatch):
    monkeypatch.setattr(kernels, "liger_functions", lambda: {"rms_norm": None, "swiglu": None, "rope": None})
    model = tiny_hybrid()
    before = [type(m) for m in model.modules()]
    counts = kernels.use_fused_kernels(model)
    assert counts["gated_deltanet"] == 1 and counts["rms_norm"] > 0
    kernels.restore_reference_kernels(model, (kernels._FusedGatedDeltaNet,))
    assert not any(isinstance(m, kernels._FusedGatedDeltaNet) for m in model.modules())
    assert any(isinstance(m, kernels._FusedRMSNorm) for m in model.modules())
    kernels.restore_reference_kernels(model)
    assert [type(m) for m in model.modules()] == before


@pytest.mark.skipif(not varlen_kernels_ready() or kernels.fla_gdn_functions() is None,
                    reason="needs a CUDA device and flash-linear-attention")
def test_on_a_gpu_fla_gated_deltanet_matches_transformers_layer_at_the_4b_shape_packed():
    """One Qwen3.5-4B Gated DeltaNet (hidden 2560, 16 key / 32 value heads of 128), bf16, a 4,096-token packed row
    of 20 samples: fla's path against transformers' forward on fla's rule (the path it replaces), output and every
    gradient within bf16 tolerance."""
    import copy

    import transformers
    import transformers.models.qwen3_5.modeling_qwen3_5 as qwen35

    cfg = transformers.Qwen3_5TextConfig(hidden_size=2560, linear_num_key_heads=16, linear_num_value_heads=32,
                                         linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                                         layer_types=["linear_attention"], num_hidden_layers=1)
    torch.manual_seed(0)
    reference = qwen35.Qwen3_5GatedDeltaNet(cfg, 0).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in reference.parameters():  # the init's scales are not a trained layer's; keep outputs O(1)
            p.copy_(torch.randn_like(p) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.5))
    fused = copy.deepcopy(reference)
    kernels.patch_gated_deltanet()
    fused.__class__ = kernels._fused_class(type(reference), kernels._FusedGatedDeltaNet)
    lengths = torch.full((20,), 4096 // 20)
    lengths[-1] += 4096 - int(lengths.sum())
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()]).cuda()
    x = torch.randn(1, 4096, 2560, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(1, 4096, 2560, device="cuda", dtype=torch.bfloat16)

    def run(layer):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        out = layer(xi, cu_seq_lens_q=starts)
        out.backward(dy)
        return out.float(), {"x": xi.grad.float(), **{n: p.grad.float() for n, p in layer.named_parameters()}}

    ref_out, ref_grads = run(reference)
    out, grads = run(fused)
    rel = {"output": float((out - ref_out).norm() / ref_out.norm())}
    rel.update({name: float((g - ref_grads[name]).norm() / ref_grads[name].norm().clamp(min=1e-12))
                for name, g in grads.items()})
    print("relative difference, fla path against transformers' layer:",
          " ".join(f"{name}={r:.2e}" for name, r in rel.items()))
    assert rel["output"] < 1e-2
    assert all(r < 3e-2 for r in rel.values()), rel
