"""stitch-qwen packs Qwen3.5's hybrid layers with sample boundaries: rows flattened to one, conv and rule restarted.

On CPU the rule runs sample by sample on transformers' PyTorch code and the conv on stitch's reference; on a GPU
with flash-linear-attention both run fla's varlen kernels (the GPU test; see BENCHMARKS.md).
"""

from __future__ import annotations

import functools
import inspect
import logging

import pytest
import torch

from stitch.data.packing import Sample, collate_packs
from stitch.host.host import get_host, load_plugins
from stitch.kernels.varlen import varlen_kernels_ready
from stitch.model.loading import load_model, packs_loaded
from stitch_qwen.kernels import _conv, _rule, patch_gated_deltanet, use_varlen

SAMPLES = [[5, 9, 14, 22, 31, 8], [40, 41, 7, 66, 80, 12, 3, 3, 19, 27, 11], [8, 2, 60, 61], [17, 4, 4, 90, 5]]


def packed_vs_alone(name: str, device: str, dtype: torch.dtype):
    spec = load_plugins().get("models", name)
    stock = load_model(spec, dtype=dtype, registry=get_host()).to(device).eval()
    packed_model = load_model(spec, dtype=dtype, registry=get_host()).to(device).eval()
    use_varlen(packed_model)
    samples = [Sample(f"r{i}", ids, ids, torch.empty(0)) for i, ids in enumerate(SAMPLES)]
    batch = collate_packs([samples[:2], samples[2:]], pad_id=0, packed=True).to(device)
    with torch.no_grad():
        packed = packed_model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        # stitch's own calls carry embeddings (soft tokens scattered in), not ids: both are flattened the same way
        embeds = packed_model.get_input_embeddings()(batch.input_ids)
        from_embeds = packed_model(inputs_embeds=embeds, position_ids=batch.position_ids, use_cache=False).logits
        assert torch.equal(packed, from_embeds)
        leaky = stock(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        alone = [stock(input_ids=torch.tensor([ids], device=device)).logits[0] for ids in SAMPLES]
    spans = [(0, 0, 6), (0, 6, 17), (1, 0, 4), (1, 4, 9)]
    ours = [packed[r, a:b] for r, a, b in spans]
    theirs = [leaky[r, a:b] for r, a, b in spans]
    return ours, theirs, alone


@pytest.mark.parametrize("name", ["qwen3.5-tiny", "qwen3.5-moe-tiny"])
def test_packed_rows_with_sample_starts_equal_each_sample_alone_while_stock_packing_leaks(name):
    ours, theirs, alone = packed_vs_alone(name, "cpu", torch.float32)
    for mine, ref in zip(ours, alone, strict=True):
        assert (mine - ref).abs().max() < 1e-4
    # the control: the stock model on the same packed rows lets the state of a sample run into the next. On a machine
    # with fla and a GPU, load_model already fits the sample-start path to every Qwen3.5 it loads, so no stock model
    # is at hand there: the control runs where load_model leaves the model stock (CI's CPU machine)
    stock = load_model(load_plugins().get("models", name), registry=get_host())
    if packs_loaded(load_plugins().get("models", name), stock):
        return
    assert max(float((t - ref).abs().max()) for t, ref in zip(theirs[1:], alone[1:], strict=True)) > 1e-3


def test_wrappers_without_sample_starts_call_the_originals_unchanged():
    patch_gated_deltanet()
    torch.manual_seed(0)
    x, w, b = torch.randn(1, 12, 9), torch.randn(12, 4), torch.randn(12)
    conv_calls, rule_calls = [], []

    def conv(*args, **kwargs):
        conv_calls.append(kwargs)
        return args[0] * 2

    def rule(*args, **kwargs):
        rule_calls.append(kwargs)
        return args[0], None

    assert torch.equal(_conv(conv)(x, w, b, activation="silu", foo=1), x * 2) and conv_calls[0]["foo"] == 1
    out, _ = _rule(rule)(x, x, x, x, x, initial_state=None, cu_seqlens=None)
    assert out is x and rule_calls[0]["cu_seqlens"] is None
    assert patch_gated_deltanet() == 2  # idempotent: both modules still wrapped once


def test_on_fla_every_layers_rule_gets_the_same_int64_starts_and_their_host_copy(monkeypatch):
    import stitch_qwen.kernels as kernels

    # fla's chunk_gated_delta_rule builds its chunk indices from cu_seqlens_cpu when given it, and otherwise reads
    # the device; it caches them by tensor identity, so every layer must see the same two objects
    monkeypatch.setattr(kernels, "_on_fla", lambda t: True)
    seen = []

    def rule(*args, **kwargs):
        seen.append(kwargs)
        return args[0], None

    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    x = torch.randn(1, 9, 2, 4)
    for _layer in range(2):
        _rule(rule)(x, x, x, x, x, initial_state=None, cu_seqlens=cu)
    first, second = seen
    assert first["cu_seqlens"].dtype == torch.int64 and first["cu_seqlens"].tolist() == [0, 4, 9]
    assert first["cu_seqlens_cpu"].device.type == "cpu" and first["cu_seqlens_cpu"].tolist() == [0, 4, 9]
    assert second["cu_seqlens"] is first["cu_seqlens"] and second["cu_seqlens_cpu"] is first["cu_seqlens_cpu"]
    assert first["initial_state"] is None


@pytest.mark.skipif(not varlen_kernels_ready(), reason="needs a CUDA device and flash-linear-attention")
@pytest.mark.parametrize("name", ["qwen3.5-tiny", "qwen3.5-moe-tiny"])
def test_fla_packed_rows_equal_each_sample_alone_on_a_gpu(name):
    ours, _, alone = packed_vs_alone(name, "cuda", torch.float32)
    for mine, ref in zip(ours, alone, strict=True):
        assert (mine - ref).abs().max() < 2e-3 * ref.abs().max()


def test_training_packs_a_hybrid_only_when_its_loader_installed_the_sample_start_path(monkeypatch):
    import stitch_qwen.models as qwen_models

    spec = load_plugins().get("models", "qwen3.5-tiny")
    monkeypatch.setattr(qwen_models, "varlen_kernels_ready", lambda: False)  # no GPU / fla: nothing installed
    plain = load_model(spec, registry=get_host())
    assert not packs_loaded(spec, torch.nn.ModuleDict({"lm": plain}))  # as inside StitchedModel / peft
    monkeypatch.setattr(qwen_models, "varlen_kernels_ready", lambda: True)
    fitted = load_model(spec, registry=get_host())
    assert packs_loaded(spec, torch.nn.ModuleDict({"lm": fitted}))
    assert not packs_loaded(spec, plain)  # the outcome belongs to the model it was reported for


def test_a_transformers_without_the_wrapped_functions_is_refused_by_name(monkeypatch):
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

    monkeypatch.delattr(modeling, "causal_conv1d_fn")
    with pytest.raises(RuntimeError, match="causal_conv1d_fn"):
        patch_gated_deltanet()


@pytest.mark.parametrize("cuda", [True, False])
def test_loading_on_a_gpu_without_the_extra_warns_once_naming_it_and_cpu_stays_quiet(monkeypatch, caplog, cuda):
    from stitch.kernels import varlen

    spec = load_plugins().get("models", "qwen3.5-tiny")
    monkeypatch.setattr(varlen, "_SAID", set())
    monkeypatch.setattr("torch.cuda.is_available", lambda: cuda)
    monkeypatch.setattr(varlen, "fla_kernels_importable", lambda: "flash-linear-attention is not installed")
    with caplog.at_level(logging.INFO, logger="stitch"):
        for _ in range(2):  # two loads, one process
            assert not packs_loaded(spec, load_model(spec, registry=get_host()))
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "[kernels]" in r.getMessage()]
    assert len(said) == cuda
    assert all('pip install "stitch-qwen[kernels]"' in line for line in said)


def test_a_hopper_gpu_with_a_triton_fla_refuses_trains_on_the_pytorch_rule_and_names_the_pin(monkeypatch, caplog):
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as moe_modeling

    from stitch.kernels import varlen

    spec = load_plugins().get("models", "qwen3.5-tiny")
    ids = torch.tensor([[5, 9, 14, 22, 31, 8, 40, 41]])
    expected = load_model(spec, registry=get_host())(input_ids=ids, labels=ids).loss
    current = modeling.torch_chunk_gated_delta_rule
    reference = inspect.unwrap(getattr(current, "stitch_original", current))  # under packing's wrapper, if any

    @functools.wraps(reference)  # what transformers' kernel-hub decorator holds once fla imports
    def fla_rule(*args, **kwargs):
        raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results")

    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", fla_rule)
    # the MoE module is switched too: give it back its own function after the test
    monkeypatch.setattr(moe_modeling, "torch_chunk_gated_delta_rule", moe_modeling.torch_chunk_gated_delta_rule)
    monkeypatch.setattr(varlen, "_SAID", set())
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(varlen, "fla_kernels_importable", lambda: None)
    monkeypatch.setattr(varlen, "installed_version", lambda name: "3.6.0" if name == "triton" else None)
    with caplog.at_level(logging.INFO, logger="stitch"):
        model = load_model(spec, registry=get_host())
    (said,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said.startswith("stitch-qwen[kernels]: Triton 3.6.0") and 'pip install "triton>=3.7.1"' in said
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # the forward runs here, on CPU tensors
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.equal(loss, expected)


def test_cpu_tensors_take_transformers_pytorch_rules_when_fla_is_what_transformers_imported(monkeypatch):
    """On a GPU machine transformers takes fla's Triton rules for every call, and those fail on CPU tensors: a
    loaded model's CPU prefill (chunk rule) and cached decode (recurrent rule) run transformers' PyTorch rules."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as moe_modeling

    from stitch_qwen.kernels import RULES

    spec = load_plugins().get("models", "qwen3.5-tiny")
    ids = torch.tensor([[5, 9, 14, 22, 31, 8, 40, 41]])
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    expected = load_model(spec, registry=get_host()).generate(ids, **kwargs)
    for module in (modeling, moe_modeling):
        for attr in RULES:
            current = getattr(module, attr)
            reference = inspect.unwrap(getattr(current, "stitch_original", current))

            @functools.wraps(reference)  # what transformers' kernel-hub decorator holds once fla imports
            def fla_rule(query, *args, _attr=attr, **kwargs):
                raise RuntimeError(f"{_attr}: Triton kernels take CUDA tensors, got {query.device}")

            monkeypatch.setattr(module, attr, fla_rule)
    model = load_model(spec, registry=get_host())
    # the guard, under packing's wrapper where load_model fitted the sample-start path
    assert all(getattr(getattr(modeling, a), "stitch_original", getattr(modeling, a)).stitch_device_guard for a in RULES)
    assert torch.equal(model.generate(ids, **kwargs), expected)
