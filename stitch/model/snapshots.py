"""Random-init snapshots in a published checkpoint layout, written shard by shard from a meta-device model
(``write_random_weights``); the tiny presets' build cache is ``stitch.plugins.snapshot_cache``."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from stitch.runs.atomic import write_text_atomic

# -- random-init snapshots in a published checkpoint layout ------------------------------------------------


@dataclass(frozen=True)
class ShardPlan:
    """Which checkpoint keys go to which shard file, planned on the meta device before any tensor exists."""

    files: tuple[tuple[str, tuple[str, ...]], ...]  # (file name, unit prefixes) in write order
    weight_map: dict[str, str]  # checkpoint key -> file name
    total_bytes: int


def _owners(model: Any) -> dict[Any, Any]:
    """Each module's nearest enclosing ``PreTrainedModel`` whose config has ``initializer_range`` (a VLM's text
    and vision towers initialise with their own configs; top-level heads fall back to the text model's)."""
    from transformers import PreTrainedModel  # deferred: plugin loading skips transformers

    owners: dict[Any, Any] = {}

    def walk(module: Any, owner: Any) -> None:
        if isinstance(module, PreTrainedModel) and hasattr(module.config, "initializer_range"):
            owner = module
        owners[module] = owner
        for child in module.children():
            walk(child, owner)

    walk(model, None)
    fallback = owners[model.get_input_embeddings()]
    return {module: owner or fallback for module, owner in owners.items()}


def _units(model: Any, budget: int) -> list[tuple[str, Any]]:
    """Modules small enough to materialise one at a time (at most ``budget`` bytes, or a leaf), in order; each
    owns its direct parameters only where it is split further."""
    units: list[tuple[str, Any]] = []

    def size(module: Any) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    def visit(prefix: str, module: Any) -> None:
        if size(module) <= budget or not list(module.children()):
            units.append((prefix, module))
            return
        if list(module.parameters(recurse=False)) or list(module.buffers(recurse=False)):
            units.append((prefix, _Direct(module)))
        for name, child in module.named_children():
            visit(f"{prefix}{name}.", child)

    visit("", model)
    return units


class _Direct:
    """A module's own parameters and buffers, without its children (a unit whose children are units too)."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def materialise(self, device: str = "cpu") -> None:
        for name, param in list(self.module.named_parameters(recurse=False)):
            setattr(self.module, name, torch.nn.Parameter(torch.empty_like(param, device=device),
                                                          requires_grad=param.requires_grad))
        for name, buf in list(self.module.named_buffers(recurse=False)):
            self.module.register_buffer(name, torch.empty_like(buf, device=device),
                                        persistent=name not in self.module._non_persistent_buffers_set)

    def modules(self) -> list[Any]:
        return [self.module]

    def state_dict(self) -> dict[str, Any]:
        return {n: t for n, t in self.module.state_dict().items() if "." not in n}

    def to(self, device: str) -> None:
        for name, param in list(self.module.named_parameters(recurse=False)):
            setattr(self.module, name, torch.nn.Parameter(param.to(device), requires_grad=param.requires_grad))


def plan_shards(model: Any, saved_keys: set[str], rename: Callable[[str], str], max_shard_bytes: int,
                unit_budget: int) -> tuple[ShardPlan, list[tuple[str, Any]]]:
    """Shard files for ``model`` (on the meta device) with checkpoint key names: each unit's state dict through
    transformers' own ``revert_weight_conversion`` (what ``save_pretrained`` writes: per-expert tensors for fused
    experts) and then ``rename``. Only ``saved_keys`` are kept (tied duplicates are not)."""
    from transformers.core_model_loading import (
        revert_weight_conversion,  # deferred: plugin loading skips transformers
    )

    units = _units(model, unit_budget)
    groups: list[tuple[list[str], dict[str, int]]] = [([], {})]
    for prefix, unit in units:
        state = {prefix + k: v for k, v in unit.state_dict().items() if prefix + k in saved_keys}
        if not state:
            continue
        keys = {rename(k): v.numel() * v.element_size() for k, v in revert_weight_conversion(model, state).items()}
        group = groups[-1]
        if group[0] and sum(group[1].values()) + sum(keys.values()) > max_shard_bytes:
            groups.append(([], {}))
            group = groups[-1]
        group[0].append(prefix)
        group[1].update(keys)
    count = len(groups)
    files, weight_map, total = [], {}, 0
    for i, (prefixes, keys) in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{count:05d}.safetensors" if count > 1 else "model.safetensors"
        files.append((name, tuple(prefixes)))
        weight_map.update(dict.fromkeys(keys, name))
        total += sum(keys.values())
    return ShardPlan(tuple(files), weight_map, total), units


def write_random_weights(model: Any, out_dir: Path, *, rename: Callable[[str], str] = lambda k: k,
                         max_shard_bytes: int = 5 * 2**30, unit_budget: int = 4 * 2**30, seed: int = 0,
                         progress: Callable[[str], None] | None = None, dry_run: bool = False,
                         spill_dir: Path | None = None, disk_budget_bytes: int | None = None,
                         init_device: str = "cpu") -> ShardPlan:
    """Write seeded random-init weights of ``model`` (built on the meta device, in the dtype to write) as
    safetensors shards plus ``model.safetensors.index.json``, one unit at a time: at most one shard and one unit
    are ever in host memory, so a 35B model writes on a host far smaller than its checkpoint.

    Initialisation is each tower's own ``_init_weights``; key names are what ``save_pretrained`` would write
    (``revert_weight_conversion``) passed through ``rename`` (a layout the transformers class does not restore).
    ``dry_run``: only plan (file names, keys, bytes) and report it through ``progress``; nothing is written.
    ``spill_dir`` + ``disk_budget_bytes``: once ``out_dir``'s shards reach the budget, the rest are written to
    ``spill_dir`` (e.g. /dev/shm beside a small disk) and linked from ``out_dir``, which stays one snapshot.
    ``init_device``: where each unit is materialised and initialised ("cuda" makes a 35B write disk-bound instead of
    bound by the host's random-number generation); the seed fixes the values for one device kind, and the values
    differ between devices (their generators differ). Each shard is written by a background thread while the next
    is initialised, so at most two shards are in host memory.
    """
    from transformers.core_model_loading import (
        revert_weight_conversion,  # deferred: plugin loading skips transformers
    )

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # named_parameters deduplicates: a tied head is written once, as the embedding (the published tied layout)
    saved = {n for n, _ in model.named_parameters()} | {
        n for n, _ in model.named_buffers() if _is_persistent_buffer(model, n)}
    plan, units = plan_shards(model, saved, rename, max_shard_bytes, min(unit_budget, max_shard_bytes))
    if dry_run:
        if progress is not None:
            progress(f"{len(plan.weight_map)} tensors in {len(plan.files)} shard(s), {plan.total_bytes / 2**30:.2f} GiB")
        return plan
    by_prefix = dict(units)
    owners = _owners(model)
    on_disk = 0
    torch.manual_seed(seed)  # seeds every device's generator
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer") as writer:
        pending: Future | None = None
        for file_name, prefixes in plan.files:
            shard: dict[str, torch.Tensor] = {}
            for prefix in prefixes:
                unit = by_prefix[prefix]
                if isinstance(unit, _Direct):
                    unit.materialise(init_device)
                else:
                    unit.to_empty(device=init_device)
                for module in unit.modules():
                    owners[module]._init_weights(module)
                state = {prefix + k: v for k, v in unit.state_dict().items() if prefix + k in saved}
                for key, tensor in revert_weight_conversion(model, state).items():
                    shard[rename(key)] = tensor.contiguous().to("cpu")
                unit.to("meta")  # free the unit; the shard keeps its own (reverted) tensors
            missing = [k for k, f in plan.weight_map.items() if f == file_name and k not in shard]
            if missing:
                raise RuntimeError(f"{file_name}: planned keys were not written: {missing[:5]}")
            size = sum(t.numel() * t.element_size() for t in shard.values())
            home = out_dir
            if spill_dir is not None and disk_budget_bytes is not None and on_disk + size > disk_budget_bytes:
                home = Path(spill_dir)
                home.mkdir(parents=True, exist_ok=True)
            else:
                on_disk += size
            if pending is not None:
                pending.result()  # at most one shard waits for the disk while the next is initialised
            pending = writer.submit(_write_shard, shard, size, file_name, home, out_dir, progress)
            del shard
        if pending is not None:
            pending.result()
    index = {"metadata": {"total_size": plan.total_bytes}, "weight_map": dict(sorted(plan.weight_map.items()))}
    if len(plan.files) > 1:
        _write_json(out_dir / "model.safetensors.index.json", index)
    return plan


def _write_shard(shard: dict[str, Any], size: int, file_name: str, home: Path, out_dir: Path,
                 progress: Callable[[str], None] | None) -> None:
    """One shard (``size`` bytes of tensors) to ``home`` atomically, linked from ``out_dir`` if elsewhere.

    It is written inside a folder of its own (``.<file>.partial.d``) and renamed into place. safetensors itself
    writes through a ``.tmpXXXXXX`` file beside its target, so a write killed midway leaves that file in the folder,
    and the next write of the same shard removes the folder first: a re-run leaves no partial GiBs behind."""

    partial = home / f".{file_name}.partial.d"
    shutil.rmtree(partial, ignore_errors=True)
    (home / f".{file_name}.partial").unlink(missing_ok=True)  # the partial file an older stitch wrote
    partial.mkdir(parents=True)
    save_file(shard, str(partial / file_name), metadata={"format": "pt"})
    os.replace(partial / file_name, home / file_name)
    shutil.rmtree(partial, ignore_errors=True)
    if home != out_dir:
        link = out_dir / file_name
        link.unlink(missing_ok=True)
        link.symlink_to((home / file_name).resolve())
    if progress is not None:
        progress(f"{file_name}: {len(shard)} tensors, {size / 2**30:.2f} GiB" + (f" (in {home})" if home != out_dir
                                                                                   else ""))
    shard.clear()
    _release_freed_memory()


def _release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``): shard-sized frees otherwise stay resident, and
    over a 70 GB write that retention, not the live shard, would set the host's peak."""
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): nothing to trim through this call
        pass


def _is_persistent_buffer(model: Any, key: str) -> bool:
    module_name, _, name = key.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    return name in dict(module.named_buffers(recurse=False)) and name not in module._non_persistent_buffers_set


def _write_json(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def shrink_layer_pattern(pattern: list[str], layers: int) -> list[str]:
    """``layers`` of ``pattern``'s layers, in their order, keeping the first layer of every kind it holds (a
    shortened hybrid still has each of its layer types)."""
    if not 0 < layers <= len(pattern):
        raise ValueError(f"layers={layers}: expected 1..{len(pattern)} (the published model has {len(pattern)})")
    kinds = list(dict.fromkeys(pattern))
    if layers < len(kinds):
        raise ValueError(f"layers={layers} cannot keep every layer type {kinds}; use at least {len(kinds)}")
    keep = {pattern.index(kind) for kind in kinds}
    for i in range(len(pattern)):
        if len(keep) == layers:
            break
        keep.add(i)
    return [pattern[i] for i in sorted(keep)]


def write_model_snapshot(spec: Any, out_dir: Path, **options: Any) -> None:
    """``spec``'s random-init snapshot in its published layout (``ModelSpec.snapshot``) written to ``out_dir``;
    config.json is written last, so an interrupted write is refused by ``with_local_snapshot`` as incomplete."""
    if spec.snapshot is None:
        raise ValueError(f"model {spec.name!r} declares no published checkpoint layout to write (ModelSpec.snapshot "
                         f"is unset); models that do: see `stitch models --json` (field 'snapshot')")
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists() and not options.get("dry_run"):
        raise FileExistsError(f"{out_dir} already holds a snapshot (config.json); pick an empty directory")
    spec.snapshot(out_dir, **options)
