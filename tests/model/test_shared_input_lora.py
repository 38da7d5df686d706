"""Plain LoRA projections of one input run as one autograd node (``SharedInputLoRA``, through
``shared_input_projections``) with the outputs and gradients of one ``LoRAProduct`` node per projection; the narrow
bases (at most ``NARROW`` wide, Qwen3.5's in_proj_a / in_proj_b) join the adapters' GEMM. Anything that is not plain
LoRA falls back to the modules' own forwards."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from stitch.kernels import precision

WIDTHS = {"qkv": 48, "z": 24, "b": 4, "a": 4}  # a Gated DeltaNet's four projections in miniature: two wide, two narrow


def test_shared_input_lora_gradients_match_finite_differences_and_the_formula_in_float64():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    shapes = [(300, 2), (5, 3), (4, 2)]  # one wide base (> NARROW), two narrow; ranks differ
    layout = ((1.7, False), (0.5, True), (2.0, True))
    frozen = [torch.randn(o, 6, dtype=torch.float64, generator=gen) for o, _ in shapes]
    adapters = [t for o, r in shapes for t in (torch.randn(r, 6, dtype=torch.float64, generator=gen),
                                               torch.randn(o, r, dtype=torch.float64, generator=gen))]
    adapters = [t.requires_grad_(True) for t in adapters]

    def node(x, *ab):
        tensors = [t for w, a, b in zip(frozen, ab[0::2], ab[1::2], strict=True) for t in (w, a, b)]
        return precision.SharedInputLoRA.apply(x, layout, *tensors)

    assert torch.autograd.gradcheck(node, (x, *adapters))
    for out, w, a, b, (s, _) in zip(node(x, *adapters), frozen, adapters[0::2], adapters[1::2], layout, strict=True):
        assert torch.allclose(out, x @ w.t() + s * (x @ a.t()) @ b.t())


class Projections(nn.Module):
    def __init__(self, bias: bool = False):
        super().__init__()
        for name, width in WIDTHS.items():
            setattr(self, name, nn.Linear(16, width, bias=bias))


def lora_projections(dropout: float = 0.0, bias: bool = False, dtype: torch.dtype = torch.float32):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = Projections(bias).to(dtype)
    model.requires_grad_(False)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(WIDTHS), lora_dropout=dropout,
                                             init_lora_weights=False))
    precision.lora_in_half_compute(model)
    return model, [getattr(model.base_model.model, name) for name in WIDTHS]


def outputs_and_grads(modules, grouped: bool, x):
    for m in modules:
        m.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    outs = precision.shared_input_projections(x, modules) if grouped else [m(x) for m in modules]
    nodes = {type(o.grad_fn).__name__ for o in outs}
    gen = torch.Generator().manual_seed(3)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen)).sum() for o in outs)
    loss.backward()
    grads = {f"{i}.{n}": p.grad.clone() for i, m in enumerate(modules) for n, p in m.named_parameters()
             if p.grad is not None}
    return [o.detach().float() for o in outs], {"x": x.grad.float(), **grads}, nodes


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_one_node_gives_the_outputs_and_every_gradient_of_one_lora_product_per_projection(dtype, tol):
    _, modules = lora_projections(dtype=dtype)
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref_outs, ref_grads, ref_nodes = outputs_and_grads(modules, False, x)
    outs, grads, nodes = outputs_and_grads(modules, True, x)
    assert ref_nodes == {"LoRAProductBackward"} and nodes == {"SharedInputLoRABackward"}
    assert [o.shape for o in outs] == [o.shape for o in ref_outs]
    for out, ref in zip(outs, ref_outs, strict=True):
        assert (out - ref).norm() <= tol * ref.norm()
    assert grads.keys() == ref_grads.keys() and len(grads) == 1 + 2 * len(WIDTHS)
    for name, g in grads.items():
        assert (g.float() - ref_grads[name].float()).norm() <= tol * ref_grads[name].float().norm(), name
        assert g.dtype == ref_grads[name].dtype, name  # adapters' gradients in their fp32 master dtype


@pytest.mark.parametrize("case", ["dropout while training", "a biased base", "merged", "not LoRA"])
def test_projections_that_are_not_plain_lora_run_their_own_forwards(case):
    model, modules = lora_projections(dropout=0.1 if case == "dropout while training" else 0.0,
                                      bias=case == "a biased base")
    if case == "merged":
        modules[1].merge()
    if case == "not LoRA":
        modules = [copy.deepcopy(m.base_layer) for m in modules]
    model.train()
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    outs = precision.shared_input_projections(x, modules)
    torch.manual_seed(5)
    ref = [m(x) for m in modules]
    assert not any(type(o.grad_fn).__name__ == "SharedInputLoRABackward" for o in outs)
    for out, r in zip(outs, ref, strict=True):
        assert torch.equal(out, r)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_one_node_matches_four_at_the_4b_gated_deltanet_shape():
    """Qwen3.5-4B's in_proj_qkv / z / b / a (2560 -> 8192, 4096, 32, 32), rank 16, bf16 on cuBLAS, 4,096 tokens: the
    grouped node against four LoRAProduct nodes, every output and gradient within bf16 tolerance."""
    from peft import LoraConfig, get_peft_model

    class Gdn(nn.Module):
        def __init__(self):
            super().__init__()
            for name, width in {"qkv": 8192, "z": 4096, "b": 32, "a": 32}.items():
                setattr(self, name, nn.Linear(2560, width, bias=False))

    torch.manual_seed(0)
    model = Gdn().to("cuda", torch.bfloat16)
    model.requires_grad_(False)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["qkv", "z", "b", "a"],
                                             init_lora_weights=False))
    precision.lora_in_half_compute(model)
    modules = [getattr(model.base_model.model, n) for n in ("qkv", "z", "b", "a")]
    x = torch.randn(1, 4096, 2560, device="cuda", dtype=torch.bfloat16)

    def run(grouped):
        for m in modules:
            m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        outs = precision.shared_input_projections(xi, modules) if grouped else [m(xi) for m in modules]
        gen = torch.Generator(device="cuda").manual_seed(3)
        sum((o * torch.randn(o.shape, device="cuda", dtype=o.dtype, generator=gen)).float().sum()
            for o in outs).backward()
        grads = {"x": xi.grad.float(), **{f"{i}.{n}": p.grad.float() for i, m in enumerate(modules)
                                           for n, p in m.named_parameters() if p.grad is not None}}
        return [o.float() for o in outs], grads

    ref_outs, ref_grads = run(False)
    outs, grads = run(True)
    rel = {f"out{i}": float((o - r).norm() / r.norm()) for i, (o, r) in enumerate(zip(outs, ref_outs, strict=True))}
    rel.update({n: float((g - ref_grads[n]).norm() / ref_grads[n].norm()) for n, g in grads.items()})
    print("relative difference, one node against four:", " ".join(f"{n}={r:.2e}" for n, r in rel.items()))
    assert grads.keys() == ref_grads.keys() and len(grads) == 9
    assert all(r < 1e-2 for r in rel.values()), rel


def test_the_shared_node_backward_scales_inside_its_gemms_and_launches_no_separate_multiply():
    """As ``LoRAProduct``'s: every adapter's scaling is the alpha of a GEMM in the backward, never a multiply of its
    own (a kernel launch each on a GPU)."""
    from tests.kernels.test_perf_lora_product import backward_ops

    x = torch.randn(2, 3, 16, dtype=torch.bfloat16, requires_grad=True)
    layout = ((1.7, False), (0.5, True), (2.0, True))
    tensors = []
    for out, rank in ((300, 4), (5, 4), (4, 4)):
        tensors += [torch.randn(out, 16, dtype=torch.bfloat16), torch.randn(rank, 16, requires_grad=True),
                    torch.randn(out, rank, requires_grad=True)]

    def node(x, *tensors):
        return torch.cat([o.reshape(-1) for o in precision.SharedInputLoRA.apply(x, layout, *tensors)])

    ops = backward_ops(node, x, *tensors)
    assert not [op for op in ops if op.startswith("mul")], ops
    assert ops.count("addmm") == 6, ops  # the three g B s and the three B gradients, each scaled as its alpha
