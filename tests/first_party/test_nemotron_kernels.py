"""stitch-nemotron's boundary-aware Mamba-2 mixer: the same math as transformers' mixer, samples kept apart.

On CPU the ``reference`` backend runs the math that the ``fla`` backend runs on a GPU; the GPU test compares the
two (skipped without CUDA and flash-linear-attention; run on the GPU machine, see BENCHMARKS.md).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from stitch.data.packing import Sample, collate_packs
from stitch.host.host import get_host, load_plugins
from stitch.kernels import varlen
from stitch.kernels.varlen import cu_seqlens_from_positions
from stitch.model.loading import load_model, packs_loaded
from stitch_nemotron.generation import NemotronHForCausalLM
from stitch_nemotron.kernels import (
    FLA,
    PREFILL_CHUNK,
    REFERENCE,
    install_mamba2_kernels,
    mamba2_forward,
    use_varlen,
)


def tiny_model(pattern: str = "M-*M", groups: int = 2, chunk: int = 8) -> NemotronHForCausalLM:
    from transformers import NemotronHConfig

    cfg = NemotronHConfig(
        vocab_size=97, hidden_size=48, hybrid_override_pattern=pattern, num_attention_heads=4, num_key_value_heads=2,
        head_dim=12, intermediate_size=64, mamba_num_heads=6, mamba_head_dim=8, ssm_state_size=5, n_groups=groups,
        chunk_size=chunk, conv_kernel=4, max_position_embeddings=256, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = NemotronHForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():  # decays and skips that differ per head, so a wrong head/group mapping shows
        for mixer in mixers(model):  # and projections large enough that the scan, not the D skip, dominates
            mixer.in_proj.weight.normal_(0.0, 0.3)
            mixer.A_log.copy_(torch.linspace(-1.0, 1.5, mixer.num_heads))
            mixer.dt_bias.copy_(torch.linspace(-2.0, 0.5, mixer.num_heads))
            mixer.D.copy_(torch.linspace(0.5, 1.5, mixer.num_heads))
    return model


def mixers(model):
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    return [m for m in model.modules() if isinstance(m, NemotronHMamba2Mixer)]


def test_reference_backend_equals_transformers_mixer_on_a_right_padded_batch():
    mixer = mixers(tiny_model())[0]
    torch.manual_seed(1)
    x = torch.randn(3, 21, 48)
    mask = torch.ones(3, 21, dtype=torch.long)
    mask[1, 15:] = 0
    mask[2, 6:] = 0
    with torch.no_grad():
        stock = mixer(x, attention_mask=mask)
        ours = mamba2_forward(mixer, x, mask, backend=REFERENCE)
    valid = mask.bool()
    assert (ours[valid] - stock[valid]).abs().max() < 1e-5


def test_packed_row_with_sample_starts_equals_each_sample_alone_while_the_stock_mixer_leaks():
    mixer = mixers(tiny_model())[0]
    torch.manual_seed(2)
    lengths = [7, 11, 3, 9]  # 7 < conv window + chunk: the conv and the scan state would both leak
    parts = [torch.randn(1, n, 48) for n in lengths]
    row = torch.cat(parts, dim=1)
    cu = torch.tensor([0, 7, 18, 21, 30], dtype=torch.int32)
    with torch.no_grad():
        alone = torch.cat([mixer(p) for p in parts], dim=1)
        packed = mamba2_forward(mixer, row, None, cu, backend=REFERENCE)
        leaky = mixer(row)
    assert (packed - alone).abs().max() < 1e-5
    assert (leaky[:, 7:] - alone[:, 7:]).abs().max() > 1e-3  # the control: without starts, state crosses over


def test_sample_starts_come_from_position_id_resets_across_rows():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    assert cu_seqlens_from_positions(pos).tolist() == [0, 3, 5, 6, 10, 12]
    with pytest.raises(ValueError, match="position 0"):
        cu_seqlens_from_positions(torch.tensor([[1, 2, 0]]))


def test_packed_model_with_kernel_mixers_equals_unpacked_samples_through_the_stock_model():
    stock = tiny_model("M*-M")
    swapped = tiny_model("M*-M")
    assert use_varlen(swapped, REFERENCE) == 2
    mixers_only = tiny_model("M*-M")
    install_mamba2_kernels(mixers_only, REFERENCE)
    samples = [Sample(f"r{i}", ids, ids, torch.empty(0)) for i, ids in
               enumerate([[5, 9, 14, 22, 31], [40, 41, 7, 66, 80, 12, 3, 3, 19], [8, 2, 60]])]
    batch = collate_packs([samples[:2], samples[2:]], pad_id=0, packed=True)
    with torch.no_grad():
        packed = swapped(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        alone = [stock(input_ids=torch.tensor([s.input_ids])).logits[0] for s in samples]
        # the swapped mixers without the starts behave like the stock ones (leak), so the starts did the work
        leaky = mixers_only(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
    assert (packed[0, :5] - alone[0]).abs().max() < 1e-4
    assert (packed[0, 5:14] - alone[1]).abs().max() < 1e-4
    assert (packed[1, :3] - alone[2]).abs().max() < 1e-4
    assert (leaky[0, 5:14] - alone[1]).abs().max() > 1e-3


@pytest.mark.parametrize("backend", [FLA, REFERENCE])
def test_generation_with_kernel_mixers_keeps_the_stock_cached_path(backend):
    """With a cache (passed as ``cache_params`` or, from transformers 5.24 on, ``cache``) the stock forward runs;
    the reference backend runs on CPU tensors, so here it is the one that would take a cached call otherwise."""
    stock = tiny_model()
    swapped = tiny_model()
    use_varlen(swapped, backend)
    prompt = torch.tensor([[3, 14, 15, 9, 2, 6]])
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert swapped.generate(prompt, **kwargs).tolist() == stock.generate(prompt, **kwargs).tolist()


def test_a_cached_prefill_scans_in_short_chunks_and_generates_the_stock_tokens(monkeypatch):
    """A rollout's prompt prefill on the stock PyTorch scan holds chunk x chunk products: the kernel mixers run it in
    PREFILL_CHUNK-long chunks (the same tokens as the stock model) and give the mixer its own chunk length back."""
    from transformers.models.nemotron_h import modeling_nemotron_h

    stock = tiny_model(chunk=64)
    swapped = tiny_model(chunk=64)
    use_varlen(swapped, REFERENCE)
    prompt = torch.arange(3, 3 + 2 * PREFILL_CHUNK + 5)[None]
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = stock.generate(prompt, **kwargs).tolist()
    scan, chunks = modeling_nemotron_h.mamba2_chunk_scan, []

    def spy(*args, **kw):
        chunks.append((args[1].shape[1], kw["chunk_size"]))  # (sequence length, chunk) of each scan
        return scan(*args, **kw)

    monkeypatch.setattr(modeling_nemotron_h, "mamba2_chunk_scan", spy)
    assert swapped.generate(prompt, **kwargs).tolist() == expected
    assert chunks and {chunk for length, chunk in chunks if length > 1} == {PREFILL_CHUNK}
    assert {m.chunk_size for m in mixers(swapped)} == {64}


def test_nemotron_packs_only_where_the_varlen_kernels_run(monkeypatch):
    spec = load_plugins().get("models", "nemotron-3-nano-4b")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr(varlen, "fla_kernels_importable", lambda: None)
    assert spec.supports_packing is False and spec.packs() is False
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert spec.packs() is True
    monkeypatch.setattr(varlen, "fla_kernels_importable", lambda: "flash-linear-attention is not installed")
    assert spec.packs() is False
    assert "flash-linear-attention" in spec.packing_note


def test_unknown_backend_is_refused_by_name():
    with pytest.raises(ValueError, match="'triton'"):
        install_mamba2_kernels(tiny_model(), "triton")


def gpu_mixer_and_packed_row(seed: int):
    """The tiny model's first Mamba-2 mixer on the GPU, a random 300-token row seeded by ``seed`` and its sample
    starts (one a single token long)."""
    mixer = mixers(tiny_model(chunk=64).cuda())[0]
    torch.manual_seed(seed)
    row = torch.randn(1, 300, 48, device="cuda")
    return mixer, row, torch.tensor([0, 40, 170, 171, 300], dtype=torch.int32, device="cuda")


@pytest.mark.skipif(not varlen.varlen_kernels_ready(), reason="needs a CUDA device and flash-linear-attention")
def test_fla_backend_matches_the_reference_on_a_gpu():
    mixer, row, cu = gpu_mixer_and_packed_row(3)
    with torch.no_grad():
        ref = mamba2_forward(mixer, row, None, cu, backend=REFERENCE)
        fast = mamba2_forward(mixer, row, None, cu, backend=FLA)
        ref_pad = mamba2_forward(mixer, row.expand(2, -1, -1).contiguous(), None, None, backend=REFERENCE)
        fast_pad = mamba2_forward(mixer, row.expand(2, -1, -1).contiguous(), None, None, backend=FLA)
    assert (fast - ref).abs().max() < 2e-3 * ref.abs().max()
    assert (fast_pad - ref_pad).abs().max() < 2e-3 * ref_pad.abs().max()


@pytest.mark.skipif(not varlen.varlen_kernels_ready(), reason="needs a CUDA device and flash-linear-attention")
def test_fla_backend_gives_the_reference_gradients_on_a_gpu():
    """Backward through fla's conv, scan and fused gated norm against the reference backend: the input's gradient
    and every mixer weight's (the norm's weight included), on a packed row."""
    mixer, row, cu = gpu_mixer_and_packed_row(4)
    mixer.requires_grad_(True)
    dy = torch.randn(1, 300, 48, device="cuda")

    def grads(backend):
        mixer.zero_grad(set_to_none=True)
        x = row.clone().requires_grad_(True)
        mamba2_forward(mixer, x, None, cu, backend=backend).backward(dy)
        return {"x": x.grad, **{n: p.grad for n, p in mixer.named_parameters()}}

    ref, fast = grads(REFERENCE), grads(FLA)
    assert "norm.weight" in fast and set(fast) == set(ref)
    for name, g in fast.items():
        assert (g - ref[name]).abs().max() <= 5e-3 * ref[name].abs().max(), name


# fla's fused gated norm, run by Triton's interpreter on CPU tensors, against transformers' norm of a NemotronH mixer
# (in a subprocess: the interpreter is chosen when Triton imports, and fla imported here would change transformers'
# rules for this process's other tests)
FUSED_NORM_CHECK = """
import json, torch
from transformers import NemotronHConfig
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer
from stitch_nemotron.kernels import fla_norm, reference_norm
cfg = NemotronHConfig(hidden_size=48, mamba_num_heads=12, mamba_head_dim=8, n_groups=4, ssm_state_size=5)
norm = NemotronHMamba2Mixer(cfg, 0).norm  # 96 channels in 4 groups of 24
torch.manual_seed(0)
with torch.no_grad():
    norm.weight.copy_(torch.linspace(0.5, 1.5, 96))
y, gate, dy = (torch.randn(2, 7, 96) for _ in range(3))
def run(fn):
    yi, gi, norm.weight.grad = y.clone().requires_grad_(True), gate.clone().requires_grad_(True), None
    out = fn(norm, yi, gi)
    out.backward(dy)
    return [out.detach(), yi.grad, gi.grad, norm.weight.grad]
print(json.dumps([[float((a - b).abs().max()), float(b.abs().max())] for a, b in zip(run(fla_norm), run(reference_norm))]))
"""


@pytest.mark.skipif(importlib.util.find_spec("fla") is None,
                    reason="flash-linear-attention is not installed (the check runs its kernel in Triton's interpreter)")
def test_fla_fused_gated_norm_equals_transformers_norm_forward_and_backward():
    """The arguments ``fla_norm`` hands fla's ``rmsnorm_fn`` (gate before the norm, the group size, eps, the weight)
    give transformers' gated group RMSNorm: output and the gradients of input, gate and weight."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", FUSED_NORM_CHECK], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for (diff, scale), name in zip(json.loads(done.stdout.strip().splitlines()[-1]),
                                   ("output", "input grad", "gate grad", "weight grad"), strict=True):
        assert diff <= 1e-5 * scale, (name, diff, scale)


def test_the_loader_reports_the_sample_start_path_and_training_packs_exactly_then(monkeypatch):
    import stitch_nemotron.models as nemotron_models
    from stitch.model.loading import load_model, packs_loaded

    spec = load_plugins().get("models", "nemotron-nano-tiny")
    monkeypatch.setattr(nemotron_models, "varlen_kernels_ready", lambda: False)
    plain = load_model(spec, registry=get_host())
    assert not packs_loaded(spec, plain)
    monkeypatch.setattr(nemotron_models, "varlen_kernels_ready", lambda: True)
    fitted = load_model(spec, registry=get_host())
    assert packs_loaded(spec, torch.nn.ModuleDict({"lm": fitted}))  # as inside StitchedModel / peft
    assert any(type(m).__name__ == "KernelMamba2Mixer" for m in fitted.modules())


def test_fla_seqlens_hands_every_layer_the_same_int64_device_tensor_and_host_copy():
    cu = torch.tensor([0, 40, 170, 300], dtype=torch.int32)
    first, again = varlen.fla_seqlens(cu), varlen.fla_seqlens(cu)
    # identity, not equality: fla caches its chunk indices by the tensor object, and a host copy spares the sync
    assert first["cu_seqlens"] is again["cu_seqlens"] and first["cu_seqlens_cpu"] is again["cu_seqlens_cpu"]
    assert first["cu_seqlens"].dtype == torch.int64 and first["cu_seqlens_cpu"].device.type == "cpu"
    assert first["cu_seqlens"].tolist() == [0, 40, 170, 300]
    assert varlen.fla_seqlens(None) == {"cu_seqlens": None, "cu_seqlens_cpu": None}


def test_chunk_offsets_answer_their_total_from_the_host_copy_without_reading_the_tensor():
    from tests.stitch_testing import DeviceReads

    def offsets(cu_seqlens, chunk_size):  # what fla's prepare_chunk_offsets computes
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        return torch.nn.functional.pad((lens + chunk_size - 1) // chunk_size, (1, 0)).cumsum(-1)

    known = varlen.known_chunk_offsets(offsets)
    cu = torch.tensor([0, 40, 170, 171, 300])
    plain = offsets(cu, 64)
    assert known(cu, 64) is not None and type(known(cu, 64)) is torch.Tensor  # no host copy: fla's own tensor
    varlen.attach_host_copy(torch.tensor([0, 40, 170, 171, 300], dtype=torch.int32), cu.clone(), cu)
    answer = known(cu, 64)
    with DeviceReads() as reads:
        total = answer[-1].item()
    assert total == int(plain[-1]) == 1 + 3 + 1 + 3 and reads.found == []
    assert torch.equal(answer + 0, plain) and type(answer + 0) is torch.Tensor and torch.equal(answer[:-1], plain[:-1])
    assert answer.data_ptr() == plain.data_ptr() or torch.equal(answer.as_subclass(torch.Tensor), plain)


def _scan_and_conv_syncs(cu: torch.Tensor) -> int:
    """Device syncs of fla_conv + fla_scan, forward and backward, on a packed row with sample starts ``cu``."""
    import warnings

    from stitch_nemotron.kernels import fla_scan

    gen = torch.Generator(device="cuda").manual_seed(0)
    t, heads, state, head_dim = int(cu[-1]), 4, 16, 8

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).requires_grad_(True)

    x, w = rand(1, t, 32), rand(32, 4)
    q, k, v = rand(1, t, heads, state), rand(1, t, heads, state), rand(1, t, heads, head_dim)
    g = -torch.rand(1, t, heads, device="cuda", generator=gen)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = varlen.fla_conv(x, w, None, "silu", cu).sum() + fla_scan(q, k, v, g, cu).sum()
            out.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)


@pytest.mark.skipif(not varlen.varlen_kernels_ready(), reason="needs a CUDA device and flash-linear-attention")
def test_fla_conv_and_scan_read_nothing_back_from_the_device_once_a_forward_made_its_host_copy():
    # every Mamba-2 layer of one forward calls both with the same cu_seq_lens_q tensor: the first call pays the
    # host copy, later ones must not synchronise (a fresh .long() per layer did: 5 syncs a layer were measured)
    cu = torch.tensor([0, 40, 170, 171, 300], dtype=torch.int32, device="cuda")
    _scan_and_conv_syncs(cu)  # compiles / autotunes, and makes this tensor's host copy
    assert _scan_and_conv_syncs(cu) == 0


def test_a_hopper_gpu_with_a_triton_fla_refuses_loads_the_stock_mixers_and_names_the_pin(monkeypatch, caplog):
    spec = load_plugins().get("models", "nemotron-nano-tiny")
    monkeypatch.setattr(varlen, "_SAID", set())
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(varlen, "fla_kernels_importable", lambda: None)  # fla imports...
    monkeypatch.setattr(varlen, "installed_version", lambda name: "3.6.0")  # ...against torch 2.11's Triton
    with caplog.at_level(logging.INFO, logger="stitch"):
        models = [load_model(spec, registry=get_host()) for _ in range(2)]
    (said,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said.startswith("stitch-nemotron[kernels]: Triton 3.6.0") and 'pip install "triton>=3.7.1"' in said
    for model in models:  # fla's simple-GLA backward would raise: the mixers stay transformers' own
        assert not packs_loaded(spec, model)
        assert not any(type(m).__name__ == "KernelMamba2Mixer" for m in model.modules())


def test_a_gpu_without_the_extra_loads_the_stock_mixers_and_names_the_extra(monkeypatch, caplog):
    spec = load_plugins().get("models", "nemotron-nano-tiny")
    monkeypatch.setattr(varlen, "_SAID", set())
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(varlen, "fla_kernels_importable", lambda: "flash-linear-attention is not installed")
    with caplog.at_level(logging.INFO, logger="stitch"):
        model = load_model(spec, registry=get_host())
    (said,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said.endswith('install: pip install "stitch-nemotron[kernels]"')
    assert not packs_loaded(spec, model)
