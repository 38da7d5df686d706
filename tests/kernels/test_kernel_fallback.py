"""A GPU that runs PyTorch reference code for want of a plugin's kernels extra says so once, with the install line:
the extra when a kernel is missing or broken, the Triton pin when fla meets a Triton it refuses on Hopper. CPU runs
stay quiet (the reference is the expected path there). Devices, versions and imports are simulated."""

from __future__ import annotations

import importlib
import importlib.util
import logging

import pytest

from stitch.kernels import varlen

QWEN = ("stitch-qwen[kernels]", {"fla": "flash-linear-attention", "liger_kernel": "liger-kernel"})
NEMOTRON = ("stitch-nemotron[kernels]", {"fla": "flash-linear-attention"})


@pytest.fixture
def machine(monkeypatch):
    """A machine to describe: device, capability, Triton version, whether fla and other modules import."""
    monkeypatch.setattr(varlen, "_SAID", set())

    def describe(cuda: bool = True, capability: tuple[int, int] = (9, 0), triton: str | None = "3.7.1",
                 fla: str | None = None, others_installed: bool = True) -> None:
        monkeypatch.setattr("torch.cuda.is_available", lambda: cuda)
        monkeypatch.setattr("torch.cuda.get_device_capability", lambda *a: capability)
        monkeypatch.setattr(varlen, "installed_version", lambda name: triton if name == "triton" else None)
        monkeypatch.setattr(varlen, "fla_kernels_importable", lambda: fla)
        monkeypatch.setattr(importlib.util, "find_spec", lambda module: object() if others_installed else None)
        monkeypatch.setattr(importlib, "import_module", lambda module: object())

    return describe


def warnings_said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "stitch" and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("extra,modules", [QWEN, NEMOTRON])
def test_a_gpu_without_the_extra_warns_once_per_process_naming_the_extra(machine, caplog, extra, modules):
    machine(fla="flash-linear-attention is not installed", others_installed=False)
    with caplog.at_level(logging.INFO, logger="stitch"):
        first = varlen.warn_kernel_fallback(extra, modules)
        again = varlen.warn_kernel_fallback(extra, modules)  # a second model loaded in the same process
    (said,) = warnings_said(caplog)
    assert said == first == again
    assert f'pip install "{extra}"' in said and "flash-linear-attention is not installed" in said
    assert ("liger-kernel is not installed" in said) == ("liger_kernel" in modules)


def test_the_cpu_reference_path_is_silent(machine, caplog):
    machine(cuda=False, fla="flash-linear-attention is not installed", others_installed=False)
    with caplog.at_level(logging.INFO, logger="stitch"):
        assert varlen.warn_kernel_fallback(*QWEN) is None
    assert warnings_said(caplog) == []
    assert not varlen.varlen_kernels_ready()


def test_hopper_with_a_triton_fla_refuses_names_the_triton_pin_and_keeps_fla_off(machine, caplog):
    machine(capability=(9, 0), triton="3.6.0")
    with caplog.at_level(logging.INFO, logger="stitch"):
        line = varlen.warn_kernel_fallback(*NEMOTRON)
    assert warnings_said(caplog) == [line]
    assert 'pip install "triton>=3.7.1"' in line and "Triton 3.6.0" in line and "sm_90" in line
    assert "[kernels]" in line.split(":")[0] and 'pip install "stitch-nemotron[kernels]"' not in line
    assert varlen.fla_kernels_usable() == varlen.fla_triton_problem() is not None
    assert not varlen.varlen_kernels_ready()  # fla's gated backward would raise: packing stays off


@pytest.mark.parametrize("capability,triton,refused", [
    ((9, 0), "3.7.0", True),  # torch 2.12's pin
    ((9, 0), "3.4.0", True),
    ((9, 0), "3.6.0+git9a1b", True),  # a local build label still reads as 3.6.0
    ((9, 0), "3.7.1", False),  # torch 2.13's pin
    ((9, 0), "3.8.0", False),
    ((9, 0), "3.3.1", False),  # before the bad range: fla runs its backward
    ((8, 0), "3.6.0", False),  # the refusal is Hopper's only
    ((10, 0), "3.6.0", False),
    ((9, 0), None, False),  # no Triton distribution: fla does not import, reported by the import check
])
def test_the_triton_pin_is_asked_only_on_hopper_in_fla_s_refused_range(machine, capability, triton, refused):
    machine(capability=capability, triton=triton)
    assert (varlen.fla_triton_problem() is not None) is refused
    assert varlen.varlen_kernels_ready() is not refused
    assert (varlen.kernel_fallback(*QWEN) is not None) is refused


def test_a_broken_fla_import_is_reported_with_its_error_and_the_extra(machine):
    machine(fla="flash-linear-attention does not import: ImportError: libcuda.so.1 missing")
    line = varlen.kernel_fallback(*NEMOTRON)
    assert "libcuda.so.1 missing" in line and 'pip install "stitch-nemotron[kernels]"' in line


def test_liger_missing_beside_a_refused_triton_asks_for_the_extra_which_pins_both(machine):
    machine(capability=(9, 0), triton="3.6.0", others_installed=False)
    line = varlen.kernel_fallback(*QWEN)
    assert "liger-kernel is not installed" in line and "Triton 3.6.0" in line
    assert line.endswith('pip install "stitch-qwen[kernels]"')
