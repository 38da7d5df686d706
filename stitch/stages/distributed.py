"""Data parallelism for alignment and SFT under ``torchrun``: the process group from the launcher's environment,
FSDP2 sharding of the stitched model (one unit per decoder layer, the projector, the root), rank-0-only output,
and full-tensor gathers so checkpoints keep the one-process layout (and resume at any world size).

    torchrun --nproc-per-node 2 -m stitch train sft --recipe R --out DIR

Checkpoints are written by ``stitch.stages.loop.save_checkpoint`` through the model binding from the gathered
tensors. Every rank draws the same packs from the same PackedStream and trains on ``packs[rank::world]``; the loss is
normalised by the global label-token count, so the gradient is the one-process gradient of the same batch.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, distribute_tensor

from stitch.kernels.attention import causal_lm
from stitch.model.loading import empty_model, parameters_on_meta


def launch_world_size() -> int:
    """WORLD_SIZE as torchrun set it (1 when the process was started any other way)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launch_rank() -> int:
    return int(os.environ.get("RANK", "0"))


@dataclass
class DataParallel:
    """One rank's view of the data-parallel group; ``world_size == 1`` is the plain one-process run."""

    rank: int = 0
    world_size: int = 1
    device: str | None = None  # None: the session's default (cuda if present, else cpu)

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls) -> DataParallel:
        """Join torchrun's process group (nccl on GPUs, gloo on CPU); a no-op outside torchrun.

        The group is made once per process and kept for later stages (destroyed at exit): re-creating the
        default group under torchrun reuses the same store keys, and a rank that re-joins early hangs."""
        world = launch_world_size()
        if world <= 1:
            return cls()

        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
            device, backend = f"cuda:{local_rank}", "nccl"
        else:
            device, backend = "cpu", "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, device_id=torch.device(device) if backend == "nccl" else None)
            atexit.register(_leave_group)
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device)

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    # -- model -------------------------------------------------------------------------------------
    def shard(self, model: nn.Module) -> nn.Module:
        """FSDP2 over a data-parallel mesh: each decoder layer, the projector, then the root (embeddings,
        final norm, head). Frozen base weights and their LoRA share a unit; only trainable ones reduce-scatter.
        Call after any trainable state is loaded (full tensors into the plain module) and before the optimizer
        is built (sharding replaces the parameters with DTensors)."""
        if not self.active:
            return model

        mesh = init_device_mesh(torch.device(self.device).type, (self.world_size,), mesh_dim_names=("dp",))
        for layer in reversed(decoder_layers(model.lm)):  # innermost first, should the classes nest
            fully_shard(layer, mesh=mesh)
        fully_shard(model.projector, mesh=mesh)
        fully_shard(model, mesh=mesh)
        # training calls model.loss() (and GRPO/DPO's log-probs model.token_logprobs()), not forward(): the root
        # unit must gather around them too
        register_fsdp_forward_method(model, "loss")
        register_fsdp_forward_method(model, "token_logprobs")
        return model

    def build_sharded(self, binding: Any, args: dict[str, Any], resume_from: Any = None,
                      meta_init: bool = True) -> nn.Module:
        """The FSDP2-sharded model. ``meta_init``: rank 0 alone loads the base (and restores ``resume_from``); the
        other ranks build rank 0's class from its config with parameters on the meta device, then every rank
        shards and receives only its shards from rank 0, so no rank but 0 ever holds the whole model. Otherwise
        every rank loads the whole model and sharding splits it (the earlier path)."""
        if not meta_init:
            model = binding.build_model(**args)
            if resume_from is not None:  # full tensors into the plain module; sharding then splits them
                binding.load_trainable(model, resume_from)
            return self.shard(model)

        blueprint: list[Any] = [None, None]
        if self.is_main:
            model = binding.build_model(**args)
            if resume_from is not None:
                binding.load_trainable(model, resume_from)
            base = causal_lm(model.lm)
            blueprint = [type(base), base.config]
        dist.broadcast_object_list(blueprint, src=0)
        if not self.is_main:
            lm = empty_model(binding.model_spec, blueprint[0], blueprint[1], binding.dtype)
            lm.requires_grad_(False)  # the frozen base, as ModelBinding.load_lm leaves it
            with parameters_on_meta():  # the LoRA layers and the projector too
                model = binding.build_model(**args, lm=lm)
        full = model.state_dict() if self.is_main else {}
        model = self.shard(model)
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        del full
        return model

    def rows(self, packs: list[Any]) -> list[Any]:
        """This rank's share of the global batch."""
        return packs[self.rank :: self.world_size] if self.active else packs

    def all_sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (float64, so token counts stay exact)."""
        if not self.active:
            return values

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def gather_object(self, value: Any) -> list[Any]:
        if not self.active:
            return [value]

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """``clip_grad_norm_`` over (possibly sharded) gradients: the norm of the full gradient on every rank."""
        if not self.active:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)

        grads = [p.grad for p in params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    @contextmanager
    def full_parameters(self, model: nn.Module) -> Iterator[None]:
        """Every unit gathered and kept gathered (e.g. for generation in evaluation); resharded after."""
        if not self.active:
            yield
            return

        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for unit in units:
            unit.unshard()
            unit.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for unit in units:
                unit.set_reshard_after_forward(True, recurse=False)
                unit.reshard()

    # -- checkpoints -------------------------------------------------------------------------------
    def full_trainable_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Every trainable tensor, whole and on CPU, keyed like ``model.named_parameters()``; collective:
        all ranks call it, rank 0 gets the tensors (other ranks get an empty dict)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        state = get_model_state_dict(model, options=options)
        if not any(p.requires_grad for p in model.projector.parameters()):
            # a frozen projector (train_projector: false) still gets its artifact in every checkpoint
            for key, value in model.projector.state_dict().items():
                full = (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()
                if self.is_main:
                    state[f"projector.{key}"] = full
        return state

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer.state_dict()`` with every sharded tensor gathered whole onto CPU: exactly the layout a
        one-process run saves, so optimizer.pt resumes at any world size. Collective; meaningful on rank 0."""
        state = optimizer.state_dict()
        full = {}
        for index, entry in state["state"].items():  # same order on every rank: the collectives line up
            full[index] = {
                k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu() if torch.is_tensor(v) else v
                for k, v in entry.items()
            }
        return {"state": full, "param_groups": state["param_groups"]}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load a one-process-layout optimizer state (full tensors) into an optimizer over sharded parameters."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for index, entry in state["state"].items():
            param = params[int(index)]
            if not isinstance(param, DTensor):
                continue
            for key, value in entry.items():
                if torch.is_tensor(value) and value.shape == param.shape and key != "step":
                    entry[key] = distribute_tensor(
                        value.to(device=param.device_mesh.device_type, dtype=param.dtype),
                        param.device_mesh, param.placements,
                    )
        optimizer.load_state_dict(state)


def _leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def decoder_layers(lm: nn.Module) -> list[nn.Module]:
    """The LM's repeated blocks: the classes transformers marks ``_no_split_modules`` (its own FSDP/accelerate
    wrapping unit), else the entries of the ``layers`` ModuleList."""
    base = causal_lm(lm)
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in base.modules() if type(m).__name__ in names]
    if not layers:
        for name, module in base.named_modules():
            if isinstance(module, nn.ModuleList) and name.split(".")[-1] in ("layers", "h", "blocks"):
                layers = list(module)
                break
    if not layers:
        raise RuntimeError(f"{type(base).__name__}: found no decoder layers to shard (no _no_split_modules, no "
                           f"'layers' ModuleList)")
    return layers
