"""The training-state estimate: bytes per element for weights, gradients, AdamW moments and master copies; the
parts a built model and a meta-device published shape give; the Qwen3.5-4B figures docs/recipes.md states."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from stitch.host.host import get_host
from stitch.model.memory import (
    ParameterPart,
    estimate,
    gib,
    lm_parts,
    meta_lm,
    model_parts,
    spec_training_memory,
)
from stitch_qwen.published import text_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "recipes.md"


def test_a_trained_weight_costs_weight_gradient_and_two_moments_in_its_dtype_and_a_frozen_one_its_weight():
    parts = [ParameterPart("lm", 1000, torch.bfloat16, True), ParameterPart("lm", 10, torch.bfloat16, False),
             ParameterPart("projector", 100, torch.float32, True)]
    assert estimate(parts).total == 1000 * (2 + 2 + 4) + 10 * 2 + 100 * (4 + 4 + 8)


def test_a_master_copy_adds_its_bytes_and_holds_the_moments_in_its_dtype():
    part = ParameterPart("lm", 1000, torch.bfloat16, True, master=torch.float32)
    est = estimate([part])
    assert est.total == 1000 * (2 + 2 + 8 + 4)
    assert "lm master weights (float32) 1,000 x 4 B" in est.arithmetic()


def test_model_parts_group_a_built_model_by_component_dtype_and_whether_it_trains():
    model = nn.ModuleDict({"projector": nn.Linear(4, 8), "lm": nn.Linear(8, 8, bias=False).to(torch.bfloat16)})
    model["lm"].weight.requires_grad_(False)
    parts = {(p.component, p.dtype, p.trainable): p.elements for p in model_parts(model.named_parameters())}
    assert parts == {("projector", torch.float32, True): 40, ("lm", torch.bfloat16, False): 64}


def test_qwen35_4b_published_shape_is_counted_on_the_meta_device_and_its_estimate_is_the_documented_one():
    spec = get_host().get("models", "qwen3.5-4b")
    lm = meta_lm(spec.architecture, text_config("qwen3.5-4b"), torch.bfloat16)
    assert all(p.is_meta for p in lm.parameters())  # no byte of weights
    n = sum(p.numel() for p in lm.parameters())
    projector = get_host().get("projectors", "mlp2x_gelu").build(768, spec.hidden_size)
    proj_n = sum(p.numel() for p in projector.parameters())
    full = estimate(lm_parts(lm, torch.bfloat16, "full", projector_elements=proj_n))
    assert full.total == n * 8 + proj_n * 16
    config = text_config("qwen3.5-4b")
    wide = spec_training_memory(spec, config, dtype=torch.float32, train_lm="full", projector_elements=proj_n)
    lora = spec_training_memory(spec, config, dtype=torch.bfloat16, train_lm="lora", projector_elements=proj_n)
    assert wide.total == (n + proj_n) * 16 and lora.total > n * 2
    doc = DOC.read_text()
    for text in (f"{n:,} LM weights", f"of {proj_n:,}", gib(full.total), gib(wide.total), gib(lora.total)):
        assert text in doc, f"docs/recipes.md does not state {text!r}"


def test_train_lm_layers_estimate_counts_only_the_named_layers_as_trained():
    spec = get_host().get("models", "qwen3.5-4b")
    lm = meta_lm(spec.architecture, text_config("qwen3.5-4b"), torch.bfloat16)
    parts = lm_parts(lm, torch.bfloat16, "full", lm_layers=[31])
    trained = sum(p.elements for p in parts if p.trainable)
    assert trained == sum(p.numel() for p in lm.model.layers[31].parameters())
    with pytest.raises(ValueError, match="layer 32 is not in this model; its decoder has 32 layers"):
        lm_parts(lm, torch.bfloat16, "full", lm_layers=[32])
