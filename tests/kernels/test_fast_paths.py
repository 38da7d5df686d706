"""StitchedModel's fast training path computes what the reference path computes.

Packed rows attend within each sample only (``stitch_varlen``) and give the loss and gradients of the same samples one
per padded row; the chunked LM head + cross-entropy gives the loss and gradients of full fp32 logits; generation and
padded batches are unchanged by the attention switch.
"""

from __future__ import annotations

import random

import pytest
import torch

from stitch.data.packing import Sample, collate_packs
from stitch.host.host import get_host, load_plugins
from stitch.kernels import attention, cross_entropy
from stitch.model import stitched as stitched_module
from stitch.model.loading import load_model
from stitch.model.stitched import StitchedModel
from tests.stitch_testing import DeviceReads

PRESETS = ["qwen3.5-demo", "qwen3.5-tiny", "nemotron-nano-tiny"]
FEATURE_WIDTH = 16
IMAGE_TOKENS = 3


def build(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> StitchedModel:
    """A tiny preset in fp32 with a LoRA adapter (non-zero B, so it acts) and a projector; hybrids get the sample-start
    path their loaders install (stitch's PyTorch reference on CPU)."""
    from peft import LoraConfig, get_peft_model

    host = load_plugins()
    spec = host.get("models", name)
    lm = load_model(spec, dtype=dtype, registry=get_host())
    lm.requires_grad_(False)
    if name == "qwen3.5-tiny":
        from stitch_qwen.kernels import use_varlen

        use_varlen(lm)
    elif name == "nemotron-nano-tiny":
        from stitch_nemotron.kernels import use_varlen

        use_varlen(lm)
    torch.manual_seed(seed)
    lm = get_peft_model(lm, LoraConfig(r=4, lora_alpha=8, target_modules=list(spec.lora_target_modules),
                                       init_lora_weights=False))
    hidden = lm.config.get_text_config().hidden_size
    projector = host.get("projectors", "mlp2x_gelu").build(FEATURE_WIDTH, hidden)
    placeholder = lm.config.get_text_config().vocab_size - 1
    return StitchedModel(lm, projector, placeholder)


def samples(model: StitchedModel, n: int = 4, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        text = [rng.randrange(3, 200) for _ in range(rng.randint(5, 14))]
        ids = [model.placeholder_id] * IMAGE_TOKENS + text
        labels = [-100] * (IMAGE_TOKENS + 2) + text[2:]
        out.append(Sample(f"s{i}", ids, labels, torch.randn(1, IMAGE_TOKENS, FEATURE_WIDTH, generator=gen)))
    return out


def loss_and_grads(model: StitchedModel, batch, loss_fn=None) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss, _ = (loss_fn or model.loss)(batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values())
    return float(loss.detach()), grads


def reference_loss(model: StitchedModel, batch) -> tuple[torch.Tensor, int]:
    """The loss as StitchedModel computed it before: full logits in fp32, one cross-entropy."""
    logits = model.logits(batch)[:, :-1].float()
    target = batch.labels[:, 1:]
    n = int((target != -100).sum())
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                             ignore_index=-100, reduction="sum")
    return loss / n, n


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in b)


@pytest.mark.parametrize("name", PRESETS)
def test_packed_loss_and_grads_equal_per_sample_rows_while_attention_across_samples_differs(name, monkeypatch):
    model = build(name)
    assert model.varlen_attention and attention.runs_varlen_attention(model.lm)
    pack = samples(model)
    packed = collate_packs([pack[:3], pack[3:]], pad_id=0, packed=True)
    alone = collate_packs([[s] for s in pack], pad_id=0, packed=False)
    loss_packed, grads_packed = loss_and_grads(model, packed)
    loss_alone, grads_alone = loss_and_grads(model, alone)
    assert abs(loss_packed - loss_alone) < 1e-5 * abs(loss_alone)
    assert max_rel_diff(grads_packed, grads_alone) < 1e-4

    # leaky control: the same packed rows with one "sample" per row, i.e. plain causal attention over the row
    def one_span_per_row(pos):
        rows, width = pos.shape
        cu = torch.arange(rows + 1, dtype=torch.int32) * width
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": width, "max_length_k": width}

    monkeypatch.setattr(stitched_module, "varlen_kwargs", one_span_per_row)
    leaky, _ = model.loss(packed)
    assert abs(float(leaky) - loss_alone) > 1e-4 * abs(loss_alone)


def attention_layers(model: StitchedModel) -> int:
    config = model.lm.config.get_text_config()
    kinds = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None)
    return sum(kind in ("full_attention", "attention") for kind in kinds)


@pytest.mark.parametrize("name", PRESETS)
def test_packed_call_builds_no_block_mask_and_every_attention_layer_attends_sample_by_sample(name, monkeypatch):
    import transformers.masking_utils as masking

    model = build(name)
    built, calls = [], []
    real_mask, real_attend = masking.sdpa_mask, attention.attend_per_sample
    monkeypatch.setattr(masking, "sdpa_mask", lambda *a, **k: built.append(1) or real_mask(*a, **k))
    monkeypatch.setattr(attention, "attend_per_sample", lambda *a, **k: calls.append(a[3]) or real_attend(*a, **k))
    pack = samples(model)
    model.loss(collate_packs([pack], pad_id=0, packed=True, length=60))
    layers = attention_layers(model)
    assert layers > 0 and built == [] and len(calls) == layers
    lengths = [len(s) for s in pack]
    assert calls[0].tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist(), 60]  # the padding is its own span
    model.loss(collate_packs([[s] for s in pack], pad_id=0, packed=False))  # padded rows: SDPA with its mask
    assert built and len(calls) == layers


def test_packed_call_refuses_a_layer_that_did_not_get_the_sample_starts():
    q = torch.randn(1, 2, 5, 4)

    class Layer(torch.nn.Module):
        is_causal = True

    with attention.packed_call(), pytest.raises(RuntimeError, match="without cu_seq_lens_q"):
        attention.stitch_varlen_attention(Layer(), q, q, q, None)


@pytest.mark.parametrize("name", PRESETS)
def test_chunked_cross_entropy_equals_full_fp32_logits_loss_and_grads(name, monkeypatch):
    model = build(name, seed=1)
    monkeypatch.setattr(cross_entropy, "CHUNK_TOKENS", 7)  # several chunks, the last one partial
    assert model._plain_head() is not None
    pack = samples(model, n=5, seed=3)
    for batch in (collate_packs([pack[:3], pack[3:]], 0, packed=True), collate_packs([[s] for s in pack], 0, False)):
        ours, grads = loss_and_grads(model, batch)
        ref, ref_grads = loss_and_grads(model, batch, lambda b: reference_loss(model, b))
        assert abs(ours - ref) < 1e-5 * abs(ref)
        assert max_rel_diff(grads, ref_grads) < 1e-4


def test_chunked_linear_cross_entropy_gives_hidden_weight_and_bias_grads_of_the_full_computation():
    torch.manual_seed(0)
    hidden = torch.randn(23, 8, requires_grad=True)
    head = torch.nn.Linear(8, 50)
    target = torch.randint(0, 50, (23,))
    target[[0, 5, 22]] = -100
    ours = cross_entropy.linear_cross_entropy(hidden, head, target, chunk=6) * 0.5
    ours.backward()
    mine = (hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone())
    hidden.grad = head.weight.grad = head.bias.grad = None
    ref = torch.nn.functional.cross_entropy(head(hidden).float(), target, ignore_index=-100, reduction="sum") * 0.5
    ref.backward()
    assert torch.allclose(ours, ref, rtol=1e-6)
    for got, want in zip(mine, (hidden.grad, head.weight.grad, head.bias.grad), strict=True):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # evaluation: the loss alone, no gradient work
        assert torch.allclose(cross_entropy.linear_cross_entropy(hidden, head, target, chunk=6) * 0.5, ref)


@pytest.mark.parametrize("name", PRESETS)
def test_generation_and_padded_logits_unchanged_by_the_varlen_attention(name):
    host = load_plugins()
    lm = load_model(host.get("models", name), dtype=torch.float32, registry=get_host()).eval()
    assert lm.config._attn_implementation == "sdpa"
    prompt = torch.tensor([[5, 9, 14, 22, 31, 8, 40], [0, 0, 7, 66, 80, 12, 3]])
    mask = torch.tensor([[1] * 7, [0, 0] + [1] * 5])
    with torch.no_grad():
        before = lm.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=6, do_sample=False)
        logits_before = lm(input_ids=prompt, attention_mask=mask).logits
    model = StitchedModel(lm, torch.nn.Linear(FEATURE_WIDTH, lm.config.get_text_config().hidden_size), 1)
    assert attention.runs_varlen_attention(model.lm)
    with torch.no_grad():
        after = lm.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=6, do_sample=False)
        logits_after = lm(input_ids=prompt, attention_mask=mask).logits
    assert torch.equal(before, after)
    assert torch.allclose(logits_before, logits_after, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch's varlen flash attention)")
def test_flash_varlen_equals_per_sample_sdpa_on_a_gpu():
    torch.manual_seed(0)
    q = torch.randn(1, 8, 300, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 300, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, 17, 140, 141, 300], device="cuda", dtype=torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())  # 159: the kernel's max_q / max_k
    assert attention.flash_varlen_usable(q, 0.0)
    fast = attention.attend_flash_varlen(q, k, v, cu, longest, None).float()
    ref = attention.attend_per_sample(q, k, v, cu, None).float()
    assert (fast - ref).abs().max() < 2e-2
    # the same with the kv heads repeated by hand: fewer kv heads are shared as SDPA shares them
    rep = attention.attend_flash_varlen(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), cu, longest, None)
    assert (rep.float() - ref).abs().max() < 2e-2
    # gradients (kv heads shared) match per-sample SDPA's too
    grads = []
    for attend in (lambda *a: attention.attend_flash_varlen(*a, longest, None), lambda *a: attention.attend_per_sample(*a, None)):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        attend(*leaves, cu).float().square().sum().backward()
        grads.append([t.grad.float() for t in leaves])
    for got, want in zip(*grads, strict=True):
        assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.999


def test_bf16_lm_trains_lora_and_projector_in_bf16_on_fp32_master_weights(monkeypatch):
    import copy

    from peft import LoraConfig, get_peft_model

    from stitch.kernels import precision

    host = load_plugins()
    spec = host.get("models", "qwen3.5-demo")
    lm = load_model(spec, dtype=torch.bfloat16, registry=get_host())
    lm.requires_grad_(False)
    torch.manual_seed(0)
    lm = get_peft_model(lm, LoraConfig(r=4, lora_alpha=8, target_modules=list(spec.lora_target_modules),
                                       init_lora_weights=False))
    projector = host.get("projectors", "mlp2x_gelu").build(FEATURE_WIDTH, lm.config.hidden_size).to(torch.bfloat16)
    reference = StitchedModel(copy.deepcopy(lm), copy.deepcopy(projector), lm.config.vocab_size - 1)
    model = StitchedModel(lm, projector, lm.config.vocab_size - 1)
    assert model.half_compute["lora_layers"] > 0 and model.half_compute["projector"]
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(p.dtype == torch.float32 for p in trainable.values())  # the masters

    # the reference: peft's own fp32 adapter compute (activations cast to fp32), the projector in fp32
    precision.restore_peft_lora(reference)  # the projector too: its HalfComputeLinear layers go back
    assert not any(isinstance(m, precision.HalfComputeLinear) for m in reference.modules())
    reference._projector_input_dtype = None

    seen = []
    product = precision.LoRAProduct.apply

    def recording(x, weight, bias, a, b, scaling):
        out = product(x, weight, bias, a, b, scaling)
        seen.append((x.dtype, a.dtype, out.dtype))
        return out

    monkeypatch.setattr(precision.LoRAProduct, "apply", recording)
    batch = collate_packs([samples(model)], pad_id=0, packed=True)
    loss, grads = loss_and_grads(model, batch)
    ref_loss, ref_grads = loss_and_grads(reference, batch)
    # every adapter product ran in bf16 on the fp32 masters; the reference (peft's path) never went through it
    assert len(seen) == model.half_compute["lora_layers"]
    assert set(seen) == {(torch.bfloat16, torch.float32, torch.bfloat16)}
    assert abs(loss - ref_loss) < 2e-2 * abs(ref_loss)
    for name, grad in grads.items():
        assert grad.dtype == torch.float32
        cos = torch.nn.functional.cosine_similarity(grad.flatten(), ref_grads[name].flatten(), dim=0)
        assert cos > 0.98, (name, float(cos))
    # an update far below bf16's resolution (2^-12 of each weight; bf16 keeps 2^-8) still moves the fp32 masters
    before = {n: p.detach().clone() for n, p in trainable.items()}
    with torch.no_grad():
        for p in trainable.values():
            p.sub_(p.grad.sign() * (p.abs() * 2**-12 + 1e-12))
    moved = [n for n, p in trainable.items() if p.grad.abs().max() > 0]
    assert moved and all(not torch.equal(before[n], trainable[n]) for n in moved)


def assert_matches_chunked_path(fused, hidden, head, target, chunk: int) -> None:
    """liger's loss ``fused`` of ``head(hidden)`` and its gradient against the chunked path's (bf16 tolerance)."""
    fused.backward()
    fused_grad, hidden.grad = hidden.grad.float(), None
    chunked = cross_entropy.ChunkedLinearCrossEntropy.apply(hidden, head.weight, None, target, -100, chunk)
    chunked.backward()
    assert abs(float(fused) - float(chunked)) < 1e-3 * abs(float(chunked))
    assert torch.nn.functional.cosine_similarity(fused_grad.flatten(), hidden.grad.float().flatten(), dim=0) > 0.999


@pytest.mark.skipif(not (torch.cuda.is_available() and cross_entropy._liger_loss() is not None),
                    reason="needs CUDA and liger-kernel")
def test_liger_fused_cross_entropy_equals_the_chunked_path_on_a_gpu():
    torch.manual_seed(0)
    hidden = torch.randn(600, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    head = torch.nn.Linear(64, 1000, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    target = torch.randint(0, 1000, (600,), device="cuda")
    assert cross_entropy.uses_liger(hidden)
    fused = cross_entropy.linear_cross_entropy(hidden, head, target)
    assert_matches_chunked_path(fused, hidden, head, target, 128)


def liger_chunk_rows(tokens: int, hidden: int, vocab: int, budget: int) -> int:
    """liger 0.8.5's chunk rule (fused_linear_cross_entropy_forward): next_pow2(ceil(BT / ceil(V / (c H)))) <= BT."""
    inc = -(-vocab // (budget * hidden))
    return min(1 << (-(-tokens // inc) - 1).bit_length(), tokens)


@pytest.mark.parametrize("tokens,vocab", [(1984, 248320), (4096, 248320), (1984, 151936), (100, 248320)],
                         ids=["qwen3.5-labels", "qwen3.5-all", "qwen3-labels", "few"])
def test_the_liger_chunk_budget_gives_chunks_of_about_chunk_tokens_rows_not_liger_default_skinny_ones(tokens, vocab):
    hidden = 2560
    default = liger_chunk_rows(tokens, hidden, vocab, 1)
    rows = liger_chunk_rows(tokens, hidden, vocab, cross_entropy.liger_chunk_budget(tokens, hidden, vocab))
    if tokens >= 1024:
        assert default <= 64  # what liger's own budget gives: 32 / 64-row GEMMs over the whole vocabulary
        assert cross_entropy.CHUNK_TOKENS // 2 <= rows <= cross_entropy.CHUNK_TOKENS
    else:
        assert rows == tokens  # one chunk
    logits_bytes = rows * vocab * 2  # liger keeps one bf16 chunk of logits
    assert logits_bytes <= cross_entropy.CHUNK_TOKENS * vocab * 2


@pytest.mark.skipif(not (torch.cuda.is_available() and cross_entropy._liger_function() is not None),
                    reason="needs CUDA and liger-kernel >= 0.8.5")
def test_on_a_gpu_liger_runs_the_head_in_chunk_tokens_row_gemms_with_the_chunked_path_loss_and_gradient():
    """Qwen3.5-4B's head (2560 -> 248,320) on 1,984 labelled tokens: every head GEMM liger runs has at least
    CHUNK_TOKENS / 2 rows (liger's own budget would run 62 of 32 rows), and loss and gradient equal the chunked
    path's."""
    torch.manual_seed(0)
    hidden = (torch.randn(1984, 2560, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_(True)
    head = torch.nn.Linear(2560, 248320, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    target = torch.randint(0, 248320, (1984,), device="cuda")
    target[::7] = -100
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fused = cross_entropy.linear_cross_entropy(hidden, head, target)
    rows = [e.input_shapes[0][0] for e in prof.events() if e.name in ("aten::mm", "aten::addmm", "aten::matmul")
            and e.input_shapes and len(e.input_shapes[0]) == 2 and e.input_shapes[1][-1] == 248320]
    assert rows and min(rows) >= cross_entropy.CHUNK_TOKENS // 2, rows
    assert_matches_chunked_path(fused, hidden, head, target, 1024)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("name", PRESETS)
def test_a_batch_moved_with_its_host_copy_gives_the_same_loss_and_gradients_bit_for_bit(name, packed):
    """``Batch.to`` keeps the host batch; the model then takes placeholder, label and sample positions from it
    (index_copy / index_select instead of masks). Same tokens, same order: the very same numbers."""
    model = build(name)
    pack = samples(model)
    batch = collate_packs([pack[:3], pack[3:]] if packed else [[s] for s in pack], pad_id=0, packed=packed)
    assert batch.host is None and model.host_index(batch) is None
    moved = batch.to("cpu")
    index = model.host_index(moved)
    assert index is not None and index.n_labels == int((batch.labels[:, 1:] != -100).sum())
    assert index.n_placeholders == len(pack) * IMAGE_TOKENS and (index.varlen is not None) == packed
    loss_mask, grads_mask = loss_and_grads(model, batch)
    loss_index, grads_index = loss_and_grads(model, moved)
    assert loss_index == loss_mask
    assert all(torch.equal(grads_index[k], grads_mask[k]) for k in grads_mask)


# CPU-only stand-ins for GPU kernels, which read their sample starts as host numbers by design
CPU_FALLBACKS = ("attend_per_sample", "reference_conv", "reference_scan", "if not cu.is_cuda")


@pytest.mark.parametrize("name", PRESETS)
def test_a_packed_step_with_its_host_index_runs_no_op_that_would_read_the_device(name):
    model = build(name)
    pack = samples(model)
    moved = collate_packs([pack[:3], pack[3:]], pad_id=0, packed=True).to("cpu")
    model.host_index(moved)  # made once per batch, on the host, when the batch is first used
    with DeviceReads(ignore=CPU_FALLBACKS) as reads:
        loss, _ = model.loss(moved)
        loss.backward()
    assert reads.found == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (torch's sync debug mode, varlen flash)")
def test_on_a_gpu_a_moved_packed_batch_matches_the_mask_path_and_its_step_never_syncs(monkeypatch):
    import dataclasses

    # liger's fused cross-entropy reads its label count from the device (3 syncs a step, measured on the H200):
    # this test holds stitch's own path, the chunked loss
    monkeypatch.setattr(cross_entropy, "uses_liger", lambda hidden: False)
    model = build("qwen3.5-demo", dtype=torch.bfloat16).cuda()
    pack = samples(model)
    moved = collate_packs([pack[:3], pack[3:]], pad_id=0, packed=True).to("cuda")
    loss_mask, grads_mask = loss_and_grads(model, dataclasses.replace(moved, host=None))  # device masks
    model.host_index(moved)
    loss_and_grads(model, moved)  # first use: kernels load, caches fill
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any sync inside raises
    try:
        model.zero_grad(set_to_none=True)
        loss, _ = model.loss(moved)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert float(loss) == loss_mask
    assert all(torch.equal(grads[k], grads_mask[k]) for k in grads_mask)
