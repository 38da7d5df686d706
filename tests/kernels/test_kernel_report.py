"""Start-up kernel report: a hybrid model without its fused kernels is named, with what to install."""

from __future__ import annotations

import importlib.util

import pytest

from stitch.host.host import load_plugins
from stitch.model.loading import kernel_report


@pytest.mark.parametrize("name,package", [("qwen3.5-4b", "flash-linear-attention"), ("nemotron-3-nano-4b", "flash-linear-attention")])
def test_missing_kernels_on_a_gpu_are_reported_with_the_package_to_install(monkeypatch, name, package):
    spec = load_plugins().get("models", name)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda module: None)
    (line,) = kernel_report(spec)
    assert name in line and package in line and "PyTorch reference" in line


def test_installed_kernels_and_attention_only_models_report_nothing(monkeypatch):
    host = load_plugins()
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda module: object())
    monkeypatch.setattr(importlib, "import_module", lambda module: object())
    assert kernel_report(host.get("models", "qwen3.5-4b")) == []
    assert kernel_report(host.get("models", "qwen3.5-demo")) == []


def test_installed_kernels_that_fail_to_import_are_reported_with_the_error(monkeypatch):
    spec = load_plugins().get("models", "nemotron-3-nano-4b")
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda module: object())

    def broken(module):
        raise ImportError("triton 3.6 is too old")

    monkeypatch.setattr(importlib, "import_module", broken)
    (line,) = kernel_report(spec)
    assert "nemotron-3-nano-4b" in line and "fla" in line and "triton 3.6 is too old" in line
    assert "PyTorch reference" in line
