"""NeMo AutoModel as a model backend: the same loss and LoRA gradients as the transformers path on the tiny presets
(same snapshot, fp32, CPU), and the refusals at load. Needs nemo_automodel (pip install --no-deps
nemo-automodel==0.7.0); skipped with that reason when it does not import."""

from __future__ import annotations

import importlib.util
import os
import zlib

import pytest
import torch

from stitch.model.loading import BackendError, load_model, with_backend

AUTOMODEL = importlib.util.find_spec("nemo_automodel") is not None
needs_automodel = pytest.mark.skipif(not AUTOMODEL, reason="nemo_automodel does not import: pip install --no-deps "
                                                           "nemo-automodel==0.7.0 to run the equal-loss proof")


def host():
    from stitch.host.host import get_host

    return get_host()


def padded_batch(spec, seed: int = 0):
    """Two samples of different lengths through the collator unpacked (one per row, right-padded), labels on the
    answer half, one item of soft tokens each."""
    from stitch.data.packing import Sample, collate_packs
    from stitch.model.binding import ModelBinding

    binding = ModelBinding.for_spec(host(), spec, "clip-tiny", "mlp2x_gelu")
    ids, enc = binding.sentinel_ids, binding.encoder_spec
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i, length in enumerate((20, 13)):
        body = torch.randint(10, 300, (length,), generator=gen).tolist()
        input_ids = [ids.start] + [ids.placeholder] * enc.tokens_per_item + [ids.end] + body
        labels = [-100] * (len(input_ids) - length // 2) + input_ids[len(input_ids) - length // 2:]
        samples.append(Sample(f"s{i}", input_ids, labels, torch.randn(1, enc.tokens_per_item, enc.feature_width,
                                                                      generator=gen)))
    return binding, collate_packs([[s] for s in samples], binding.pad_id, False, length=None)


def loss_and_lora_grads(spec, device: str = "cpu"):
    """Loss and LoRA/projector gradients of ``spec`` (its binding's LoRA targets) on ``padded_batch``."""
    from stitch.config.options import LoraOptions

    binding, batch = padded_batch(spec)
    batch = batch.to(device)
    lm = load_model(spec, dtype=torch.float32, device=device if device != "cpu" else None, registry=host())
    lm.requires_grad_(False)
    torch.manual_seed(1)  # the same projector and LoRA init on both backends (after loading: its RNG use differs)
    model = binding.build_model(lora=LoraOptions(r=4, alpha=8, dropout=0.0), lm=lm).to(device)
    for name, p in model.named_parameters():  # seeded by name: peft's init order follows module order, which
        # differs (AutoModel builds the shared expert's up_proj first); lora_B nonzero so A's gradient is tested
        if "lora_" in name:
            seed = zlib.crc32(name.replace("shared_experts.", "shared_expert.").encode())
            draw = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.02  # CPU generator
            with torch.no_grad():
                p.copy_(draw.to(p.device, p.dtype))
    model.train()
    loss, n = model.loss(batch)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None and ("lora_" in name or name.startswith("projector.")):
            # module names differ only where AutoModel renames (shared_experts)
            grads[name.replace("shared_experts.", "shared_expert.")] = p.grad.detach().cpu().clone()
    return float(loss.detach()), n, grads


def assert_equal_loss_and_gradients(model: str, device: str, loss_tol: float, grad_tol: float) -> None:
    spec = host().get("models", model)
    ref_loss, ref_n, ref_grads = loss_and_lora_grads(spec, device)
    am_loss, am_n, am_grads = loss_and_lora_grads(with_backend(spec, "automodel"), device)
    assert am_n == ref_n > 0
    assert abs(am_loss - ref_loss) < loss_tol, (am_loss, ref_loss)
    assert set(am_grads) == set(ref_grads) and any("lora_A" in k for k in ref_grads)
    # whole-tensor relative error: fp32 sums run in another order (AutoModel's grouped experts, its own norms)
    errors = {name: float((am_grads[name] - grad).norm() / grad.norm().clamp_min(1e-12))
              for name, grad in ref_grads.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] < grad_tol, (worst, errors[worst])


@needs_automodel
@pytest.mark.parametrize("model", ["qwen3.5-moe-tiny", "qwen3.5-tiny"])
def test_automodel_backend_gives_the_transformers_loss_and_lora_gradients(model, monkeypatch):
    # for this test only: a value left in os.environ would reach every later test's CLI subprocess
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    assert_equal_loss_and_gradients(model, "cpu", 1e-5, 2e-3)


@needs_automodel
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("model", ["qwen3.5-moe-tiny", "qwen3.5-tiny", "nemotron-lightning-tiny",
                                   "nemotron-nano-tiny"])
def test_gpu_automodel_backend_gives_the_transformers_loss_and_lora_gradients(model):
    """On the GPU both backends run their kernels (fla, torch._grouped_mm, mamba_ssm for AutoModel's Nemotron):
    fp32 weights, tolerances for TF32-free kernels that sum in another order."""
    if model.startswith("nemotron") and importlib.util.find_spec("mamba_ssm") is None:
        pytest.skip("AutoModel's Nemotron-H Mamba-2 mixer needs mamba_ssm, which is not installed")
    assert_equal_loss_and_gradients(model, "cuda", 1e-3, 1e-2)


@needs_automodel
def test_automodel_backend_lora_adapter_saves_and_reloads_exactly(tmp_path):
    from stitch.config.options import LoraOptions

    spec = with_backend(host().get("models", "qwen3.5-moe-tiny"), "automodel")
    binding, _ = padded_batch(spec)
    model = binding.build_model(lora=LoraOptions(r=4, alpha=8, dropout=0.0), lm=load_model(spec, registry=host()).requires_grad_(False))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    binding.save_trainable(model, tmp_path / "step", stage="sft")
    saved = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    assert any("shared_experts" in n for n in saved)
    reloaded = binding.build_model(adapter_from=tmp_path / "step" / "adapter",
                                   projector_from=tmp_path / "step" / "projector", lm=model.lm.unload())
    got = {n: p.detach() for n, p in reloaded.named_parameters() if "lora_" in n}
    assert set(got) == set(saved)
    assert all(torch.equal(got[n], saved[n]) for n in saved)
    # the artifact says which implementation its adapter names belong to; serve/export refuse it, naming it
    from stitch.model.artifacts import read_projector_manifest
    from stitch.model.binding import ModelBinding

    manifest = read_projector_manifest(tmp_path / "step" / "projector")
    assert manifest["base_model_backend"] == "automodel"
    with pytest.raises(BackendError, match="trained on model.backend 'automodel'"):
        ModelBinding.for_artifact(manifest, "checkpoint step", registry=host())


def test_backend_the_plugin_does_not_offer_is_refused_by_name():
    spec = host().get("models", "qwen3.5-tiny")
    with pytest.raises(BackendError, match=r"model.backend: model 'qwen3.5-tiny' offers the backends "
                                           r"\['transformers', 'automodel'\], not 'megatron'"):
        with_backend(spec, "megatron")


def test_automodel_backend_without_its_package_names_the_extra(monkeypatch):
    import importlib

    real = importlib.import_module

    def missing(name, *args, **kwargs):
        if name == "nemo_automodel":
            raise ModuleNotFoundError("No module named 'nemo_automodel'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", missing)
    with pytest.raises(BackendError, match=r'needs the package .nemo_automodel.*pip install "stitch-qwen\[automodel\]"'):
        with_backend(host().get("models", "qwen3.5-moe-tiny"), "automodel")


def test_recipe_on_automodel_with_a_generating_stage_is_refused_before_weights_load(monkeypatch):
    import dataclasses

    from stitch.model.binding import check_stages_fit_backend
    from stitch.plugins.specs import ModelBackend

    spec = host().get("models", "qwen3.5-tiny")
    backend = dataclasses.replace(spec.backends["automodel"], requires=())
    assert isinstance(backend, ModelBackend)
    spec = with_backend(dataclasses.replace(spec, backends={"automodel": backend}), "automodel")

    class Opts:
        eval_partition = "eval"

    class NoEval:
        eval_partition = None

    class Recipe:
        stages = {"sft": Opts(), "grpo": NoEval()}

    with pytest.raises(BackendError, match=r"stages.grpo, stages.sft.eval_partition need"):
        check_stages_fit_backend(Recipe(), spec)
    Recipe.stages = {"sft": NoEval()}
    check_stages_fit_backend(Recipe(), spec)  # SFT without evaluation trains on AutoModel


def test_recipe_model_backend_field_is_typed_and_kept_in_the_resolved_recipe():
    from pathlib import Path

    import yaml

    from stitch.config.recipe import RecipeError, parse_recipe

    path = Path(__file__).resolve().parents[2] / "stitch_qwen" / "recipes" / "qwen3.6-35b-a3b.yaml"
    mapping = yaml.safe_load(path.read_text())
    name = mapping["model"] if isinstance(mapping["model"], str) else mapping["model"]["name"]
    mapping["model"] = {"name": name, "backend": "automodel"}
    recipe = parse_recipe(mapping, path=path)
    assert recipe.model_backend == "automodel"
    assert recipe.resolved()["model"] == {"name": name, "backend": "automodel"}
    mapping["model"] = {"name": name, "backend": "megatron"}
    with pytest.raises(RecipeError, match="model.backend"):
        parse_recipe(mapping, path=path)
