"""NeMo AutoModel as a model backend (``model.backend: automodel``): builds AutoModel's own model class on the meta
device from a snapshot's HF config and fills it layer by layer through AutoModel's HF state-dict adapter, so the host
holds one decoder layer at a time. stitch's projector, scatter, LoRA and provenance sit on top unchanged."""

from __future__ import annotations

import copy
import functools
import importlib
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from stitch.plugins.specs import ModelBackend, ModelSpec

# what stitch cannot do on AutoModel 0.7.0's classes, checked before any weight loads (stitch.model.loading)
REFUSES: dict[str, str] = {
    "generate": "AutoModel's text models have no KV cache (use_cache=True raises) and no generate(), so GRPO "
    "rollouts, evaluation (eval_partition) and inference cannot run on them; set eval_partition: null, keep GRPO "
    "on the transformers backend",
    "vllm": "vLLM refit ships weights under transformers' names, which AutoModel renames (fused experts, "
    "shared_experts)",
    "export": "a merged export is written under transformers' names; AutoModel's differ",
    "packing": "AutoModel packs through its own indexed-document masks (packed_token_indices + cu_seqlens), not "
    "stitch's position-id resets; this backend trains one sample per row",
}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def automodel_backend(model_class: str, lora_target_modules: Iterable[str], install: str,
                      prepare: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
                      kernels: tuple[str, ...] = (), description: str = "") -> ModelBackend:
    """A ``ModelBackend`` loading ``model_class`` (``"module:Class"`` inside nemo_automodel); ``prepare`` maps one
    layer's HF tensors to the layout AutoModel's adapter reads (e.g. per-expert tensors fused), None: as they are;
    ``kernels``: imports the class cannot run without (AutoModel's Mamba-2 mixer calls mamba_ssm, with no fallback)."""
    return ModelBackend(
        name="automodel",
        load=functools.partial(load_automodel, model_class, prepare),
        requires=("nemo_automodel", *kernels),
        install=install,
        lora_target_modules=tuple(lora_target_modules),
        refuses=REFUSES,
        description=description or f"NeMo AutoModel's {model_class.rsplit(':', 1)[-1]}",
    )


class AutoModelLM:
    """What stitch calls on an LM that AutoModel's classes lack; mixed into the class before it is built."""

    def get_decoder(self) -> torch.nn.Module:
        return self.model  # type: ignore[attr-defined]  # the decoder ends in its final norm, as transformers'

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: Mapping[str, Any] | None = None) -> None:
        """Recompute each decoder layer in backward (non-reentrant); module names, hence LoRA keys, stay."""
        kwargs = {"use_reentrant": False, **(gradient_checkpointing_kwargs or {})}
        layers = self.get_decoder().layers
        for layer in layers.values() if isinstance(layers, torch.nn.ModuleDict) else layers:
            if getattr(layer, "_stitch_checkpointed", False):
                continue
            forward = layer.forward

            def recomputed(*args: Any, _forward: Callable[..., Any] = forward, **kw: Any) -> Any:
                if not torch.is_grad_enabled():
                    return _forward(*args, **kw)
                return checkpoint(_forward, *args, **kwargs, **kw)

            layer.forward = recomputed
            layer._stitch_checkpointed = True

    def enable_input_require_grads(self) -> None:
        """Only reentrant checkpointing needs inputs that require grad; stitch's is non-reentrant."""


@functools.cache
def _stitch_class(model_class: str) -> type:
    module, name = model_class.split(":")
    cls = getattr(importlib.import_module(module), name)
    return type(name, (AutoModelLM, cls), {"__module__": __name__})


def _backend_config(device: torch.device) -> Any:
    from nemo_automodel.components.models.common import (
        BackendConfig,  # optional: nemo_automodel ([automodel] extra)
    )

    # no TransformerEngine on stitch's machines: torch linears and SDPA; grouped GEMM (torch._grouped_mm) for the
    # routed experts on a GPU, AutoModel's per-expert loop on the CPU; no expert parallelism (one process)
    return BackendConfig(attn="sdpa", linear="torch", rms_norm="torch", rope_fusion=False, dispatcher="torch",
                         experts="torch_mm" if device.type == "cuda" else "torch")


def _tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else value[:]  # a lazy safetensors slice reads here


def load_automodel(model_class: str, prepare: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None,
                   spec: ModelSpec, config: Any, state_dict: Mapping[str, Any], dtype: torch.dtype,
                   device: str | torch.device | None) -> torch.nn.Module:
    """``model_class`` built from ``config`` on the meta device, its weights read from ``state_dict`` (HF text
    layout, lazy) one decoder layer at a time through the class's ``state_dict_adapter.from_hf``, onto ``device``.

    A checkpoint that ties its head to the embeddings loads into a class that keeps them apart (AutoModel's Qwen3.5
    classes) as an equal copy: the base is frozen, so the two never diverge. A key that lands nowhere, or a weight
    the checkpoint lacks, is refused by name."""
    from nemo_automodel.shared.tied_weights import TieSupport  # optional: nemo_automodel ([automodel] extra)

    device = torch.device(device or "cpu")
    cls = _stitch_class(model_class)
    config = copy.deepcopy(config)
    config.dtype = dtype
    tie_by_copy = bool(getattr(config, "tie_word_embeddings", False)) and \
        getattr(cls, "tie_word_embeddings_support", None) is TieSupport.UNTIED_ONLY
    if tie_by_copy:
        config.tie_word_embeddings = False
    with torch.device("meta"):
        model = cls(config, backend=_backend_config(device))
    expected = dict(model.state_dict(keep_vars=True))
    # what AutoModel keeps in fp32 under a bf16 model (SSM gates, router bias); its HF-derived submodules are built
    # in the default dtype, so every other floating tensor takes ``dtype`` here
    keep_fp32 = (*(getattr(model, "_keep_in_fp32_modules", None) or ()),
                 *(getattr(model, "_keep_in_fp32_modules_strict", None) or ()))
    groups: dict[str, list[str]] = {}
    for key in state_dict:
        found = _LAYER.search(key)
        groups.setdefault(found.group(1) if found else "", []).append(key)
    loaded: set[str] = set()
    for _, keys in sorted(groups.items()):
        hf = {key: _tensor(state_dict[key]) for key in keys}
        native = model.state_dict_adapter.from_hf(prepare(hf) if prepare else hf)
        unplaced = sorted(set(native) - set(expected))
        if unplaced:
            raise ValueError(f"model {spec.name!r} on AutoModel's {cls.__name__}: checkpoint keys {unplaced[:6]} "
                             f"land on no parameter (from {keys[:3]}...); this snapshot is not the layout "
                             f"{cls.__name__} reads")
        native = {k: v.to(device=device, dtype=_dtype_of(k, v, dtype, keep_fp32)) for k, v in native.items()}
        model.load_state_dict(native, strict=False, assign=True)
        loaded |= set(native)
        del hf, native
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in loaded:
        model.tie_weights()  # assign=True replaced the embedding the meta build had tied the head to
        loaded.add("lm_head.weight")
    elif tie_by_copy and "lm_head.weight" not in loaded:
        model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone(),
                                                  requires_grad=False)
        loaded.add("lm_head.weight")
    missing = sorted(k for k, v in expected.items() if k not in loaded and isinstance(v, torch.nn.Parameter))
    if missing:
        raise ValueError(f"model {spec.name!r} on AutoModel's {cls.__name__}: the checkpoint has no weights for "
                         f"{missing[:6]} ({len(missing)} in all); they would train from uninitialised memory")
    _rebuild_meta_buffers(model, device)
    return model.eval()


def _dtype_of(key: str, value: torch.Tensor, dtype: torch.dtype, keep_fp32: tuple[str, ...]) -> torch.dtype:
    if not value.is_floating_point():
        return value.dtype
    return torch.float32 if any(part in key.split(".") for part in keep_fp32) else dtype


def _rebuild_meta_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Buffers no checkpoint holds (rotary frequency tables) are computed at construction, which the meta device
    skipped: rebuild their modules from their config, on ``device``."""
    for name, module in list(model.named_modules()):
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        if getattr(module, "config", None) is None:
            raise ValueError(f"{type(model).__name__}.{name} ({type(module).__name__}) has buffers on the meta device "
                             f"and no config to rebuild them from")
        parent, _, attr = name.rpartition(".")
        with torch.device(device):
            setattr(model.get_submodule(parent), attr, type(module)(config=module.config))
