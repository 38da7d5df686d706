"""Loading base LMs and tokenizers from a ModelSpec through ``from_pretrained`` (safetensors only)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from stitch.plugins.specs import ModelSource, ModelSpec

log = logging.getLogger("stitch")


def load_tokenizer(spec: ModelSpec, source: ModelSource | None = None, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    source = source or spec.source
    return AutoTokenizer.from_pretrained(**source.pretrained_kwargs(), trust_remote_code=trust_remote_code)


def kernel_report(spec: ModelSpec) -> list[str]:
    """What will run PyTorch reference code because a kernel the model plugin declares is missing or broken."""
    import importlib
    import importlib.util

    if not spec.kernels:
        return []
    if not torch.cuda.is_available():
        return [f"{spec.name}: no CUDA device, so {', '.join(sorted(spec.kernels))} kernels are not used; "
                f"hybrid layers run the PyTorch reference"]
    missing = {module: package for module, package in spec.kernels.items() if importlib.util.find_spec(module) is None}
    lines = []
    if missing:
        lines.append(f"{spec.name}: {', '.join(sorted(missing))} not installed; its hybrid layers fall back to the "
                     f"PyTorch reference (several times slower, see BENCHMARKS.md). Install: pip install "
                     f"{' '.join(missing.values())}")
    for module in sorted(set(spec.kernels) - set(missing)):
        try:  # installed but unusable (e.g. fla against a Triton that is too old): say why
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - any import-time failure is the report
            lines.append(f"{spec.name}: {module} is installed but does not import ({type(exc).__name__}: "
                         f"{str(exc)[:200]}); its hybrid layers fall back to the PyTorch reference")
    return lines


def load_model(
    spec: ModelSpec,
    source: ModelSource | None = None,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
) -> Any:
    """The base LM of ``spec``; weights come from safetensors only, remote code only when asked for."""
    source = source or spec.source
    if spec.load is not None:
        model = spec.load(spec, source, dtype, trust_remote_code)
    else:
        import transformers

        cls = getattr(transformers, spec.architecture)
        model = cls.from_pretrained(
            **source.pretrained_kwargs(), dtype=dtype, trust_remote_code=trust_remote_code, use_safetensors=True
        )
    # every projector for this model is built to the declared width: refuse a checkpoint that differs
    actual = model.config.get_text_config().hidden_size
    if actual != spec.hidden_size:
        raise ValueError(
            f"model {spec.name!r} declares hidden_size={spec.hidden_size} but {source.describe()} has "
            f"hidden_size={actual}; fix the ModelSpec (projectors are built to the declared width)"
        )
    for line in kernel_report(spec):
        # said once at start-up: a hybrid model without its kernels is several times slower on a GPU
        (log.warning if torch.cuda.is_available() else log.info)(line)
    return model


def packs_loaded(spec: ModelSpec, model: Any) -> bool:
    """Whether ``model`` (loaded from ``spec``) trains on packed rows here: the binding packs natively, or its
    loader wired sample boundaries into this model (hybrid layers with varlen kernels)."""
    if spec.supports_packing:
        return True
    return spec.packs() and any(getattr(m, "stitch_varlen", False) for m in model.modules())
