"""Loading base LMs and tokenizers from a ModelSpec through ``from_pretrained`` (safetensors only)."""

from __future__ import annotations

from typing import Any

import torch

from stitch.specs import ModelSource, ModelSpec


def load_tokenizer(spec: ModelSpec, source: ModelSource | None = None, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    source = source or spec.source
    return AutoTokenizer.from_pretrained(**source.pretrained_kwargs(), trust_remote_code=trust_remote_code)


def load_model(
    spec: ModelSpec,
    source: ModelSource | None = None,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
) -> Any:
    """The base LM of ``spec``; weights come from safetensors only, remote code only when asked for."""
    source = source or spec.source
    if spec.load is not None:
        return spec.load(spec, source, dtype, trust_remote_code)
    import transformers

    cls = getattr(transformers, spec.architecture)
    return cls.from_pretrained(
        **source.pretrained_kwargs(), dtype=dtype, trust_remote_code=trust_remote_code, use_safetensors=True
    )
