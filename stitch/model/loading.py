"""Loading base LMs and tokenizers from a ModelSpec through ``from_pretrained`` (safetensors only).

The core owns the load path: it resolves the binding's state-dict adapter by name through the registry and
applies it to snapshots in the adapter's source layout, and it records whether the binding's
``install_sample_starts`` fitted the loaded model for packed training (``packs_loaded``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import importlib
import importlib.util
import json
import logging
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from huggingface_hub import snapshot_download
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer

from stitch.plugins.registry import Registry
from stitch.plugins.specs import ModelSource, ModelSpec, StateDictAdapterSpec

log = logging.getLogger("stitch")

# Models whose binding installed the sample-start path at load time (held weakly: a dropped model leaves).
_WITH_SAMPLE_STARTS: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def load_tokenizer(spec: ModelSpec, source: ModelSource | None = None, trust_remote_code: bool = False) -> Any:
    source = source or spec.source
    return AutoTokenizer.from_pretrained(**source.tokenizer_kwargs(), trust_remote_code=trust_remote_code)


# -- snapshots ----------------------------------------------------------------------------------------------


def local_snapshot(source: ModelSource) -> Path:
    """A directory holding the snapshot: the local path / built preset, or the pinned hub revision's json and
    safetensors files (nothing else is fetched)."""
    kwargs = source.pretrained_kwargs()
    path = Path(kwargs["pretrained_model_name_or_path"])
    if path.is_dir():
        return path

    return Path(snapshot_download(repo_id=kwargs["pretrained_model_name_or_path"], revision=kwargs.get("revision"),
                                  allow_patterns=["*.json", "*.safetensors"]))


class SnapshotError(ValueError):
    """A local snapshot directory that cannot stand in for a model's published checkpoint."""


def with_local_snapshot(spec: ModelSpec, directory: Path | str) -> ModelSpec:
    """``spec`` reading its tokenizer and weights from the local snapshot ``directory`` instead of its source.

    Refused here, before any weight is read, when the directory is missing, lacks config.json or safetensors
    weights, or its text model's hidden size is not ``spec.hidden_size`` (projectors are built to that width).
    """
    directory = Path(directory)
    where = f"model {spec.name!r}: local snapshot {str(directory)!r}"
    if not directory.is_dir():
        raise SnapshotError(f"{where} is not a directory; write one with `stitch snapshot {spec.name} --out DIR` "
                            f"or point model.snapshot at a downloaded HF snapshot")
    found = sorted(p.name for p in directory.iterdir())
    if "config.json" not in found:
        raise SnapshotError(f"{where} has no config.json (found: {found[:12]}); an HF-format snapshot needs its "
                            f"config.json next to the weights (a snapshot still being written has none yet)")
    if "model.safetensors" not in found and "model.safetensors.index.json" not in found:
        raise SnapshotError(f"{where} has no model.safetensors or model.safetensors.index.json (found: "
                            f"{found[:12]}); stitch loads weights from safetensors only")

    actual = AutoConfig.from_pretrained(directory, trust_remote_code=False).get_text_config().hidden_size
    if actual != spec.hidden_size:
        raise SnapshotError(f"{where} has hidden_size={actual} (config.json), but model {spec.name!r} declares "
                            f"hidden_size={spec.hidden_size}; this snapshot is not that model (projectors are "
                            f"built to the declared width)")
    return dataclasses.replace(spec, source=spec.source.with_local_path(str(directory.resolve())))


class BackendError(ValueError):
    """A recipe's ``model.backend`` that this model's plugin does not offer, or whose package is not installed."""


def with_backend(spec: ModelSpec, backend: str) -> ModelSpec:
    """``spec`` loading through its plugin's ``backend`` (``"transformers"``: as registered), its LoRA targets under
    that backend's module names. Refused here, before any weight is read, when the plugin offers no such backend or
    the package it needs does not import (the message names the extra to install)."""
    if backend == "transformers":
        return spec
    offered = ["transformers", *spec.backends]
    if backend not in spec.backends:
        raise BackendError(f"model.backend: model {spec.name!r} offers the backends {offered}, not {backend!r}")
    chosen = spec.backends[backend]
    for module in chosen.requires:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - any import failure means the backend cannot run here
            raise BackendError(f"model.backend: {backend!r} for model {spec.name!r} needs the package {module!r}, "
                               f"which does not import ({type(exc).__name__}: {str(exc)[:160]}); install it with "
                               f"{chosen.install}") from None
    return dataclasses.replace(spec, backend=backend, lora_target_modules=chosen.lora_target_modules)


def refused_by_backend(spec: ModelSpec, feature: str) -> str | None:
    """Why ``spec``'s backend cannot serve ``feature`` (``generate``, ``vllm``, ``export``, ``packing``), or None."""
    if spec.backend == "transformers":
        return None
    return spec.backends[spec.backend].refuses.get(feature)


_SAMPLED_BYTES = 1 << 20  # of each weight file's tensor data, at its start, middle and end


def snapshot_fingerprint(directory: Path | str) -> str:
    """The identity provenance records for a local snapshot: sha256 over its top-level json files (config, weight
    index, tokenizer, generation config) and, per safetensors file, its name, size, header and 1 MiB of tensor bytes
    at the start, middle and end. A different config, tokenizer, layout or dtype, or re-initialised or re-trained
    weights, change it; it reads a few MiB per shard, not the shards (an edit confined to the unsampled middle of a
    shard is not seen)."""
    directory = Path(directory)
    digest = hashlib.sha256()
    for path in sorted(directory.glob("*.json")) + sorted(directory.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as handle:
            if path.suffix == ".json":
                digest.update(handle.read())
                continue
            header = int.from_bytes(handle.read(8), "little")
            digest.update(handle.read(header))
            start = 8 + header
            for offset in (start, start + (size - start) // 2, size - _SAMPLED_BYTES):
                handle.seek(max(start, offset))
                digest.update(handle.read(_SAMPLED_BYTES))
    return digest.hexdigest()


def source_fingerprint(source: ModelSource) -> str | None:
    """``snapshot_fingerprint`` of a source read from a local directory (a snapshot path, a built preset); None for
    a hub repo, whose pinned revision is already its identity (nothing is downloaded here)."""
    if source.local_path is None and source.builder is None:
        return None
    return snapshot_fingerprint(source.pretrained_kwargs()["pretrained_model_name_or_path"])


class SafetensorsStateDict(Mapping[str, Any]):
    """A read-on-access view of a snapshot's safetensors shards (``model.safetensors`` or an index): an adapter's
    ``convert`` reads only the tensors it keeps. ``lazy``: values are safetensors slices that ``from_pretrained``
    reads one at a time, as it does for its own checkpoints, so a 35B snapshot never sits in host memory whole."""

    def __init__(self, snapshot: Path, lazy: bool = False) -> None:
        snapshot = Path(snapshot)
        self.lazy = lazy
        index = snapshot / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            self._files = {key: snapshot / name for key, name in weight_map.items()}
        elif (snapshot / "model.safetensors").exists():
            path = snapshot / "model.safetensors"
            with safe_open(path, framework="pt") as handle:
                self._files = {key: path for key in handle.keys()}  # noqa: SIM118 (safe_open is not a dict)
        else:
            found = sorted(p.name for p in snapshot.iterdir())
            raise FileNotFoundError(
                f"{snapshot} has no model.safetensors or model.safetensors.index.json (found: {found}); "
                f"stitch loads weights from safetensors only"
            )
        self._handles: dict[Path, Any] = {}

    def __getitem__(self, key: str) -> Any:
        path = self._files[key]
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt")
        handle = self._handles[path]
        return handle.get_slice(key) if self.lazy else handle.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


# -- models -------------------------------------------------------------------------------------------------


def state_dict_adapter(spec: ModelSpec, registry: Registry | None) -> StateDictAdapterSpec | None:
    """The registered adapter ``spec.state_dict_adapter`` names (None when it names none); a name nobody
    registered fails here, naming the model and the plugin to install."""
    if spec.state_dict_adapter is None:
        return None
    if registry is None:
        raise ValueError(f"model {spec.name!r} loads through the state-dict adapter {spec.state_dict_adapter!r}: "
                         f"pass the registry it is registered in (load_model(..., registry=host))")
    return registry.get("state_dict_adapters", spec.state_dict_adapter)


def _load_through_adapter(spec: ModelSpec, adapter: StateDictAdapterSpec, snapshot: Path, source: ModelSource,
                          dtype: torch.dtype, trust_remote_code: bool, device: str | None) -> Any:
    cls = getattr(transformers, spec.architecture)
    config = transformers.AutoConfig.from_pretrained(snapshot, trust_remote_code=trust_remote_code)
    state_dict = adapter.convert(SafetensorsStateDict(snapshot, lazy=True))
    if adapter.convert_config is not None:
        config = adapter.convert_config(config, state_dict)
    placement = {"device_map": device} if device is not None else {}
    model, info = cls.from_pretrained(None, config=config, state_dict=state_dict, dtype=dtype,
                                      output_loading_info=True, trust_remote_code=trust_remote_code, **placement)
    problems = {k: sorted(v) for k, v in info.items() if v}
    if problems:  # a missing or unexpected key would load as random init or be dropped silently: refuse
        raise ValueError(f"loading {spec.architecture} for model {spec.name!r} from {source.describe()} through "
                         f"the state-dict adapter {adapter.name!r} left problems: {problems}")
    return model.eval()


def load_model(
    spec: ModelSpec,
    source: ModelSource | None = None,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    registry: Registry | None = None,
    device: str | None = None,
) -> Any:
    """The base LM of ``spec``; weights come from safetensors only, remote code only when asked for.

    ``device`` (e.g. ``"cuda"``): weights load from the shards straight onto it (``device_map``), so the host never
    holds the model; a binding's own ``load`` loads on the host as before.

    A snapshot in the source layout of the binding's state-dict adapter (resolved by name through ``registry``,
    needed only by a spec that names one) is read through that adapter; then the binding's
    ``install_sample_starts`` fits the model for packed training where it can (see ``packs_loaded``).
    """
    source = source or spec.source
    adapter = state_dict_adapter(spec, registry)
    if spec.backend != "transformers":
        model = _load_through_backend(spec, adapter, source, dtype, trust_remote_code, device)
        _check_hidden_size(spec, source, model)
        return model
    if adapter is not None and spec.load is not None:
        raise ValueError(f"model {spec.name!r} declares both a custom load and the state-dict adapter "
                         f"{adapter.name!r}; the core applies adapters on its own load path only, so drop one")
    snapshot = local_snapshot(source) if adapter is not None else None
    if spec.load is not None:
        model = spec.load(spec, source, dtype, trust_remote_code)
    elif adapter is not None and (adapter.applies_to is None or adapter.applies_to(snapshot)):
        log.info("%s: %s is in the %s layout; loading through the state-dict adapter %r", spec.name,
                 source.describe(), adapter.source_layout, adapter.name)
        model = _load_through_adapter(spec, adapter, snapshot, source, dtype, trust_remote_code, device)
    else:
        cls = getattr(transformers, spec.architecture)
        kwargs = {"pretrained_model_name_or_path": str(snapshot)} if snapshot else source.pretrained_kwargs()
        if device is not None:
            kwargs["device_map"] = device
        model = cls.from_pretrained(**kwargs, dtype=dtype, trust_remote_code=trust_remote_code, use_safetensors=True)
    _check_hidden_size(spec, source, model)
    _fit_for_packing(spec, model)
    return model


def _check_hidden_size(spec: ModelSpec, source: ModelSource, model: Any) -> None:
    # every projector for this model is built to the declared width: refuse a checkpoint that differs
    actual = model.config.get_text_config().hidden_size
    if actual != spec.hidden_size:
        raise ValueError(
            f"model {spec.name!r} declares hidden_size={spec.hidden_size} but {source.describe()} has "
            f"hidden_size={actual}; fix the ModelSpec (projectors are built to the declared width)"
        )


def _load_through_backend(spec: ModelSpec, adapter: StateDictAdapterSpec | None, source: ModelSource,
                          dtype: torch.dtype, trust_remote_code: bool, device: str | None) -> Any:
    """The spec's non-transformers backend fed the snapshot's text config and a lazy read of its weights in the
    text layout (through the binding's state-dict adapter where the snapshot is in the adapter's source layout)."""
    snapshot = local_snapshot(source)
    config = transformers.AutoConfig.from_pretrained(snapshot, trust_remote_code=trust_remote_code)
    state_dict: Mapping[str, Any] = SafetensorsStateDict(snapshot, lazy=True)
    if adapter is not None and (adapter.applies_to is None or adapter.applies_to(snapshot)):
        state_dict = adapter.convert(state_dict)
        if adapter.convert_config is not None:
            config = adapter.convert_config(config, state_dict)
    log.info("%s: loading %s through the %r backend", spec.name, source.describe(), spec.backend)
    return spec.backends[spec.backend].load(spec, config.get_text_config(), state_dict, dtype, device)


def _fit_for_packing(spec: ModelSpec, model: Any) -> None:
    if spec.install_sample_starts is not None and spec.install_sample_starts(model):
        _WITH_SAMPLE_STARTS.add(model)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside keep their parameters on the meta device (no memory); buffers stay real, because
    non-persistent ones (rotary frequency tables) are computed at construction and no checkpoint restores them."""
    original = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: Any) -> None:
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    torch.nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


def empty_model(spec: ModelSpec, cls: type, config: Any, dtype: torch.dtype) -> Any:
    """``cls`` built from ``config`` (what another rank loaded) with its parameters on the meta device, fitted for
    packed training like a loaded one; its weights arrive later (``DataParallel.build_sharded``)."""
    config = copy.deepcopy(config)
    # the attention rank 0's model runs was chosen after its load (StitchedModel registers stitch's varlen path
    # then): start from the default here, and StitchedModel makes the same choice again
    config._attn_implementation_internal = None
    with parameters_on_meta():
        model = cls._from_config(config, dtype=dtype)
    _fit_for_packing(spec, model.eval())
    return model


def packs_loaded(spec: ModelSpec, model: Any) -> bool:
    """Whether ``model`` (loaded from ``spec`` by ``load_model``, possibly wrapped since: peft, StitchedModel)
    trains on packed rows here: the binding packs natively (``supports_packing``), or its
    ``install_sample_starts`` reported at load time that it fitted this model with the sample-start path."""
    if refused_by_backend(spec, "packing"):
        return False
    if spec.supports_packing:
        return True
    return any(module in _WITH_SAMPLE_STARTS for module in model.modules())
