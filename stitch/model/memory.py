"""What a stage's training state takes in device memory, before it is allocated: weights, gradients, AdamW's two
moments and fp32 master copies, per component and dtype, with the arithmetic spelled out; and the memory a device
offers. Activations, the CUDA context and allocator slack come on top and are not estimated."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import transformers
from torch import nn

from stitch.model.lm_weights import selected_parameters
from stitch.model.loading import parameters_on_meta
from stitch.plugins.specs import ModelSpec

GIB = 1024**3
ADAM_MOMENTS = 2  # AdamW keeps exp_avg and exp_avg_sq, each in its parameter's dtype


class TrainingMemoryError(MemoryError):
    """A stage whose training state does not fit the device memory it declares (or the device has)."""


@dataclass(frozen=True)
class ParameterPart:
    """Parameters of one component held alike: how many elements, their dtype, whether they train, and the dtype
    of an fp32 master copy the optimizer steps instead of them (None: they step in their own dtype)."""

    component: str  # lm, projector, adapter
    elements: int
    dtype: torch.dtype
    trainable: bool
    master: torch.dtype | None = None


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def gib(n: float) -> str:
    """Bytes as GiB with four significant digits (31.46 GiB, 0.0001 GiB)."""
    return f"{n / GIB:.4g} GiB"


@dataclass(frozen=True)
class MemoryTerm:
    """One line of the estimate: ``elements x bytes_per_element = bytes``."""

    what: str
    elements: int
    bytes_per_element: int

    @property
    def bytes(self) -> int:
        return self.elements * self.bytes_per_element

    def __str__(self) -> str:
        return f"{self.what} {self.elements:,} x {self.bytes_per_element} B = {gib(self.bytes)}"


@dataclass(frozen=True)
class MemoryEstimate:
    terms: tuple[MemoryTerm, ...]

    @property
    def total(self) -> int:
        return sum(t.bytes for t in self.terms)

    def arithmetic(self) -> str:
        """Every term and the sum, on one line."""
        return "; ".join(str(t) for t in self.terms) + f"; total {gib(self.total)}"


def estimate(parts: Iterable[ParameterPart]) -> MemoryEstimate:
    """Weights of every part; for trainable parts also the gradient (in the parameter's dtype), AdamW's moments
    (in the master's dtype when there is one) and the master copy."""
    terms = []
    for p in parts:
        dtype = str(p.dtype).removeprefix("torch.")
        state = p.master or p.dtype
        terms.append(MemoryTerm(f"{p.component} weights ({dtype}, {'trained' if p.trainable else 'frozen'})",
                                p.elements, _size(p.dtype)))
        if not p.trainable:
            continue
        terms.append(MemoryTerm(f"{p.component} gradients ({dtype})", p.elements, _size(p.dtype)))
        terms.append(MemoryTerm(f"{p.component} AdamW moments (2 x {str(state).removeprefix('torch.')})",
                                p.elements, ADAM_MOMENTS * _size(state)))
        if p.master is not None:
            terms.append(MemoryTerm(f"{p.component} master weights ({str(p.master).removeprefix('torch.')})",
                                    p.elements, _size(p.master)))
    return MemoryEstimate(tuple(t for t in terms if t.elements))


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The training state as allocated, to set beside ``estimate``: the bytes of every distinct storage among the
    model's parameters, their gradients and the optimizer's state tensors (a rank's shards under FSDP2). AdamW's
    per-parameter step counters (0-d) are left out, as the estimate leaves them out."""
    storages: dict[tuple[str, int], int] = {}

    def add(tensor: object) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            return
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # FSDP2's DTensor: this rank's shard
        if local.device.type != "meta":
            storage = local.untyped_storage()
            storages[(str(local.device), storage.data_ptr())] = storage.nbytes()

    for param in model.parameters():
        add(param)
        add(param.grad)
    for state in optimizer.state.values():
        for value in state.values():
            add(value)
    return sum(storages.values())


def model_parts(named: Iterable[tuple[str, nn.Parameter]]) -> list[ParameterPart]:
    """The parts of a built stitched model's parameters (``StitchedModel.named_parameters()``), each counted once,
    grouped by component (``projector.``, LoRA, the rest of ``lm.``), dtype and whether it trains. Half-precision
    training keeps the projector and LoRA as fp32 parameters (stitch.kernels.precision), so their dtype says so."""
    counts: dict[tuple[str, torch.dtype, bool], int] = {}
    for name, param in named:
        component = "projector" if name.startswith("projector.") else "adapter" if "lora_" in name else "lm"
        key = (component, param.dtype, param.requires_grad)
        counts[key] = counts.get(key, 0) + param.numel()
    return [ParameterPart(c, n, d, t) for (c, d, t), n in sorted(counts.items(), key=lambda kv: str(kv[0]))]


def lora_elements(lm: nn.Module, targets: Sequence[str], rank: int) -> int:
    """Elements of a rank-``rank`` LoRA on every Linear whose name ends in one of ``targets``: r x (in + out)."""
    return sum(rank * (m.in_features + m.out_features) for name, m in lm.named_modules()
               if isinstance(m, nn.Linear) and name.split(".")[-1] in targets)


def device_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what they are) that ``device`` offers: a GPU's total memory, else this machine's RAM."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.total_memory, f"the total memory of {device} ({props.name})"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"


def lm_parts(lm: nn.Module, dtype: torch.dtype, train_lm: str, *, lm_layers: Sequence[int | str] | None = None,
             lora_targets: Sequence[str] = (), lora_rank: int = 16, projector_elements: int = 0,
             where: str = "train_lm_layers") -> list[ParameterPart]:
    """The parts a stage would train, from an LM whose parameters may sit on the meta device (nothing allocated):
    ``train_lm`` full (all weights or ``lm_layers``) or lora (rank ``lora_rank`` on ``lora_targets``); the LM in
    ``dtype``; the projector and LoRA as fp32 parameters (half-precision compute on fp32 masters)."""
    named = dict(lm.named_parameters())
    trained = set(selected_parameters(lm, lm_layers, where)) if train_lm == "full" else set()
    train_n = sum(named[n].numel() for n in trained)
    parts = [ParameterPart("lm", sum(p.numel() for p in named.values()) - train_n, dtype, False),
             ParameterPart("lm", train_n, dtype, True),
             ParameterPart("projector", projector_elements, torch.float32, True)]
    if train_lm == "lora":
        parts.append(ParameterPart("adapter", lora_elements(lm, lora_targets, lora_rank), torch.float32, True))
    return parts


def meta_lm(architecture: str, config: object, dtype: torch.dtype) -> nn.Module:
    """The transformers class ``architecture`` built from ``config`` with its parameters on the meta device: the
    published shape's names and sizes without a byte of weights (or a download)."""
    with parameters_on_meta():
        return getattr(transformers, architecture)._from_config(config, dtype=dtype)


def spec_training_memory(spec: ModelSpec, config: object, *, dtype: torch.dtype, train_lm: str,
                         lm_layers: Sequence[int | str] | None = None, lora_rank: int = 16,
                         projector_elements: int = 0) -> MemoryEstimate:
    """The training-state estimate of ``spec``'s model at the shape ``config`` gives (e.g. a published one), with
    its LoRA targets for ``train_lm: lora``; nothing is allocated or downloaded."""
    lm = meta_lm(spec.architecture, config, dtype)
    return estimate(lm_parts(lm, dtype, train_lm, lm_layers=lm_layers, lora_targets=spec.lora_target_modules,
                             lora_rank=lora_rank, projector_elements=projector_elements))
