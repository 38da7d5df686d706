"""A plain LoRA layer of a half-precision LM computes base + adapter product as one autograd node (``LoRAProduct``) with
the values and gradients of peft's own path; layers that are not plain (dropout while training, merged, disabled,
several adapters) keep peft's path, and ``restore_peft_lora`` gives peft's classes back."""

from __future__ import annotations

import copy

import pytest
import torch

from stitch.kernels import precision


def test_lora_product_gradients_match_finite_differences_in_float64():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(5, 6, dtype=torch.float64, generator=gen)
    bias = torch.randn(5, dtype=torch.float64, generator=gen)
    a = torch.randn(2, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(5, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, a, b: precision.LoRAProduct.apply(x, weight, bias, a, b, 1.7),
                                    (x, a, b))
    expected = x @ weight.t() + bias + 1.7 * (x @ a.t()) @ b.t()
    assert torch.allclose(precision.LoRAProduct.apply(x, weight, bias, a, b, 1.7), expected)


def backward_ops(fn, *inputs) -> list[str]:
    """The aten ops (by name) that the backward of ``fn(*inputs).sum()`` dispatches: one GPU kernel launch each."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
            calls.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    out = fn(*inputs).sum()
    with Record():
        out.backward()
    return [c for c in calls if c not in ("empty", "new_empty", "t", "view", "reshape", "_unsafe_view", "detach",
                                          "transpose", "alias", "expand", "split", "slice", "ones_like")]


@pytest.mark.parametrize("bias", [False, True])
def test_lora_product_backward_scales_inside_its_gemms_and_launches_no_separate_multiply(bias):
    """The adapter's scaling rides on the GEMMs as their alpha: a backward of 4 GEMMs, the input gradient's
    accumulation and the two casts to the fp32 weights, and no multiply (each is a kernel launch on a GPU, and a
    packed 4B step is paced by its launches)."""
    x = torch.randn(2, 3, 6, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(5, 6, dtype=torch.bfloat16)
    a = torch.randn(2, 6, requires_grad=True)
    b = torch.randn(5, 2, requires_grad=True)
    ops = backward_ops(precision.LoRAProduct.apply, x, weight, torch.randn(5, dtype=torch.bfloat16) if bias else None,
                       a, b, 1.7)
    assert not [op for op in ops if op.startswith("mul")], ops
    # g B s (one GEMM), g W + (g B s) A (a GEMM and an accumulating one), A's and B's gradients (a GEMM each, B's
    # scaled in it), each cast to its fp32 weight
    assert sorted(ops) == sorted(["addmm", "mm", "addmm_", "mm", "_to_copy", "addmm", "_to_copy"]), ops


def lora_lm(dropout: float = 0.0):
    import transformers
    from peft import LoraConfig, get_peft_model

    cfg = transformers.Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True)
    torch.manual_seed(0)
    lm = transformers.Qwen3ForCausalLM._from_config(cfg, attn_implementation="sdpa")
    lm.requires_grad_(False)
    return get_peft_model(lm, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                         lora_dropout=dropout, init_lora_weights=False))


def loss_and_grads(lm, ids):
    lm.zero_grad(set_to_none=True)
    embeds = lm.get_input_embeddings()(ids).requires_grad_(True)
    loss = lm(inputs_embeds=embeds, labels=ids, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in lm.named_parameters() if p.requires_grad}
    return float(loss.detach()), grads, embeds.grad.clone()


def count_products(monkeypatch) -> list:
    calls = []
    product = precision.LoRAProduct.apply
    monkeypatch.setattr(precision.LoRAProduct, "apply", lambda *a: calls.append(1) or product(*a))
    return calls


def test_one_node_lora_gives_peft_loss_and_gradients_for_every_adapter_and_the_input(monkeypatch):
    reference = lora_lm()
    lm = copy.deepcopy(reference)
    assert precision.lora_in_half_compute(lm) == 8  # fp32 here, so the comparison is exact up to fp32 rounding
    calls = count_products(monkeypatch)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    loss, grads, input_grad = loss_and_grads(lm, ids)
    assert len(calls) == 8
    ref_loss, ref_grads, ref_input_grad = loss_and_grads(reference, ids)
    assert len(calls) == 8  # the reference ran peft's path
    assert abs(loss - ref_loss) < 1e-6 * abs(ref_loss)
    assert grads.keys() == ref_grads.keys() and len(grads) == 16
    for name, g in grads.items():
        assert g.dtype == torch.float32
        assert torch.allclose(g, ref_grads[name], rtol=1e-4, atol=1e-7), name
    assert (input_grad - ref_input_grad).abs().max() < 1e-5 * ref_input_grad.abs().max(), "input gradient"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"), id="gpu")])
def test_bf16_one_node_lora_stays_within_bf16_rounding_of_the_cast_per_product_path(device, monkeypatch):
    reference = lora_lm().to(device, torch.bfloat16)
    for p in reference.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # fp32 masters, as StitchedModel keeps them
    precision.lora_in_half_compute(reference)
    lm = copy.deepcopy(reference)
    for module in reference.modules():  # the cast-per-product path: HalfComputeLinear under peft's own forward
        if isinstance(module, precision._OneNodeLoRA):
            module.__class__ = type(module).__mro__[2]
    calls = count_products(monkeypatch)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1)).to(device)
    loss, grads, _ = loss_and_grads(lm, ids)
    ref_loss, ref_grads, _ = loss_and_grads(reference, ids)
    assert len(calls) == 8
    assert abs(loss - ref_loss) < 1e-2 * abs(ref_loss)
    for name, g in grads.items():
        assert g.dtype == torch.float32
        assert torch.nn.functional.cosine_similarity(g.flatten(), ref_grads[name].flatten(), dim=0) > 0.99, name


@pytest.mark.parametrize("case", ["dropout while training", "merged", "adapters disabled"])
def test_layers_that_are_not_plain_lora_keep_peft_forward(case, monkeypatch):
    lm = lora_lm(dropout=0.1 if case == "dropout while training" else 0.0)
    precision.lora_in_half_compute(lm)
    lm.train()
    if case == "merged":
        lm.merge_adapter()
    calls = count_products(monkeypatch)
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(2))
    if case == "adapters disabled":
        with lm.disable_adapter():
            lm(input_ids=ids)
    else:
        lm(input_ids=ids)
    assert calls == []
    if case == "dropout while training":
        lm.eval()
        lm(input_ids=ids)
        assert len(calls) == 8  # dropout is the identity in eval mode: plain again


def test_restore_peft_lora_gives_back_peft_classes_and_input_casting():
    lm = lora_lm()
    before = [type(m) for m in lm.modules()]
    precision.lora_in_half_compute(lm)
    assert [type(m) for m in lm.modules()] != before
    precision.restore_peft_lora(lm)
    assert [type(m) for m in lm.modules()] == before
    assert all(m.cast_input_dtype_enabled for m in lm.modules() if hasattr(m, "cast_input_dtype_enabled"))
