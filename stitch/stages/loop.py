"""The one stage loop, in named phases: setup -> load_checkpoint -> train (log, evaluate, save_checkpoint) ->
summarize. A stage (alignment, sft, grpo, dpo) supplies only what differs: a ``Stage`` subclass with its model
arguments, ``build``/``start``, one ``step``, its data-order state and its extra summary fields.

    stitch train sft --recipe demo                                    # one process
    torchrun --nproc-per-node 2 -m stitch train sft --recipe demo     # FSDP2 data parallel (alignment, sft)
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from stitch.config.options import STAGE_OPTIONS, StageOptions
from stitch.config.recipe import Recipe, RecipeError
from stitch.config.validate import check_launch
from stitch.kernels.cpu_math import settle_cpu_math
from stitch.kernels.graphs import drop_graphs
from stitch.model.binding import ModelBinding
from stitch.model.checkpointing import checkpoint_layers
from stitch.model.memory import (
    GIB,
    MemoryEstimate,
    TrainingMemoryError,
    device_memory,
    estimate,
    gib,
    held_bytes,
    model_parts,
)
from stitch.model.provenance import check_warm_start
from stitch.plugins.registry import Registry
from stitch.runs.checkpoint import (
    latest_step_dir,
    load_step_state,
    save_step,
    seed_all,
    step_number,
    sweep_partial_steps,
    verify_checksums,
    write_text_atomic,
)
from stitch.runs.environment import environment
from stitch.runs.layout import RunLayout
from stitch.runs.lock import RunLock
from stitch.runs.metrics import MetricsLog, peak_memory_bytes
from stitch.runs.progress import progress
from stitch.runs.resume import RECIPE_NAME, check_resumable, data_digest
from stitch.runs.trackers import TrackerSet, check_trackers, open_trackers
from stitch.stages.distributed import DataParallel, launch_rank, launch_world_size
from stitch.stages.evaluation import evaluate_accuracy
from stitch.stages.profiling import StepProfiler
from stitch.stages.registry import STAGES
from stitch.stages.session import StitchSession

log = logging.getLogger("stitch")


def stage_options(recipe: Recipe, name: str) -> StageOptions:
    """The stage's typed options (the recipe holds them typed); a missing stage is refused naming it."""
    if name not in STAGE_OPTIONS:
        raise ValueError(f"unknown stage {name!r}; known: {list(STAGE_OPTIONS)}")
    return recipe.stage_options(name)


def checked_options(recipe: Recipe, name: str) -> StageOptions:
    """The stage's options after its own checks (combinations it cannot honour are refused, naming the field)."""
    opts = stage_options(recipe, name)
    STAGES[name].stage_class()(opts).check(recipe)
    return opts


def lr_lambda(opts: StageOptions) -> Callable[[int], float]:
    """The LR multiplier at a step: linear warmup over ``warmup_steps``, then cosine to 0 at ``steps`` or constant."""
    def scale(step: int) -> float:
        if opts.warmup_steps and step < opts.warmup_steps:
            return (step + 1) / opts.warmup_steps
        if opts.schedule == "constant":
            return 1.0
        progress = (step - opts.warmup_steps) / max(1, opts.steps - opts.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return scale


def parameter_group(name: str) -> str:
    """The component a parameter of a StitchedModel belongs to: projector, adapter (LoRA) or lm (its own weights)."""
    return "projector" if name.startswith("projector.") else "adapter" if "lora_" in name else "lm"


def trainable_by_group(model: Any) -> dict[str, int]:
    groups = {"projector": 0, "adapter": 0, "lm": 0}
    for name, param in model.named_parameters():
        if param.requires_grad:
            groups[parameter_group(name)] += param.numel()
    return groups


def make_optimizer(groups: list[dict[str, Any]], weight_decay: float) -> torch.optim.Optimizer:
    """AdamW over the parameter groups; its fused CUDA kernel when every parameter is on a GPU (one launch per
    step instead of torch's default multi-tensor path's dozens, a few percent of a 4B LoRA step). The state it keeps
    and saves is the same; CPU runs and sharded (FSDP2) parameters keep the default."""
    params = [p for g in groups for p in g["params"]]
    fused = bool(params) and all(p.is_cuda and type(p.data) is torch.Tensor for p in params)  # not FSDP's DTensors
    return torch.optim.AdamW(groups, weight_decay=weight_decay, **({"fused": True} if fused else {}))


def audit_gradients(model: Any, allowed: tuple[str, ...]) -> None:
    """Fail closed if any parameter outside the allowed groups is trainable or received a gradient."""
    offenders = [name for name, param in model.named_parameters()
                 if parameter_group(name) not in allowed and (param.requires_grad or param.grad is not None)]
    if offenders:
        raise RuntimeError(
            f"parameters outside {allowed} would train: {offenders[:5]}{' ...' if len(offenders) > 5 else ''}"
        )


class Stage:
    """What one stage supplies to the loop. ``opts`` is its typed options; the loop owns everything else."""

    postfix: ClassVar[tuple[str, ...]] = ("loss",)  # record fields shown on the progress bar

    def __init__(self, opts: Any) -> None:
        self.opts = opts

    def check(self, recipe: Recipe) -> None:
        """Refuse option combinations this stage cannot honour (before any data or weights load)."""

    def model_args(self) -> dict[str, Any]:
        """``ModelBinding.build_model`` arguments besides the warm start (``lora``, ``train_projector``)."""
        return {"train_projector": True}

    def build(self, ctx: StageContext) -> None:
        """After the model and optimizer exist, before a resume restores state: data, references."""

    def start(self, ctx: StageContext) -> None:
        """After a resume, before the first step (engines that copy the live weights start here)."""

    def step(self, ctx: StageContext) -> dict[str, Any]:
        """One training step: forward, backward, ``ctx.update()``; returns the step's metrics."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The stage's own resumable state (data order), JSON-serialisable."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def summary(self, ctx: StageContext, history: list[dict[str, Any]]) -> dict[str, Any]:
        """Fields this stage adds to summary.json."""
        return {}


@dataclass
class StageContext:
    """Everything the phases share; a stage's ``step`` reads the model, session and options from here."""

    recipe: Recipe
    name: str
    opts: Any
    runner: Stage
    session: StitchSession
    dp: DataParallel
    cleanup: ExitStack
    model: Any = None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    groups: list[dict[str, Any]] = field(default_factory=list)
    allowed: tuple[str, ...] = ()
    warm_start: Path | None = None
    resume_from: Path | None = None
    step: int = 0
    grad_norm: float | None = None
    memory: MemoryEstimate | None = None  # the training state's estimate (check_memory)
    memory_held: int | None = None  # the training state as allocated at the first optimizer step (held_bytes)
    progress: bool = True
    t_start: float = 0.0
    trackers: TrackerSet | None = None  # the recipe's report_to, on rank 0
    profiler: StepProfiler | None = None  # the recipe's profile_steps, on rank 0

    @property
    def layout(self) -> RunLayout:
        return self.session.layout

    @property
    def binding(self) -> ModelBinding:
        return self.session.binding

    @property
    def state_ranks(self) -> int:
        """The ranks the training state is split over: FSDP2 shards weights, gradients and moments alike."""
        return self.dp.world_size if self.dp.active else 1

    @property
    def checkpoints(self) -> Path:
        return self.layout.checkpoints(self.name)

    @property
    def metrics(self) -> MetricsLog:
        return MetricsLog(self.layout.metrics(self.name), sinks=() if self.trackers is None else (self.trackers,))

    def update(self) -> float:
        """Apply the accumulated gradients: audit them, clip to ``grad_clip`` (None: no clipping), step the
        optimizer, clear them. Returns (and records) the global grad norm before clipping."""
        audit_gradients(self.model, self.allowed)
        params = [p for g in self.groups for p in g["params"]]
        clip = self.opts.grad_clip if self.opts.grad_clip is not None else float("inf")
        norm = self.dp.clip_grad_norm(params, clip)
        self.optimizer.step()
        if self.memory_held is None:  # gradients and moments exist now, until zero_grad frees the gradients
            self.memory_held = held_bytes(self.model, self.optimizer)
            if self.dp.is_main and self.progress and self.memory is not None:
                print(f"{self.name}: training state allocated {gib(self.memory_held)} (estimated "
                      f"{gib(self.memory.total // self.state_ranks)})", file=sys.stderr)
        self.optimizer.zero_grad(set_to_none=True)
        self.grad_norm = float(norm)  # read once the step is queued: reading it earlier idles the GPU mid-step
        return self.grad_norm

    def scale_gradients(self, factor: float) -> None:
        """Multiply the accumulated gradients by ``factor`` (an accumulated sum becomes the step's mean)."""
        for group in self.groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.mul_(factor)

    def evaluate(self) -> float:
        """The recipe task's held-out accuracy on ``eval_partition`` (sharded weights gathered for generation)."""
        with self.dp.full_parameters(self.model):
            return evaluate_accuracy(self.session, self.model, self.opts.eval_partition, limit=self.opts.eval_rows,
                                     max_new_tokens=self.opts.eval_max_new_tokens,
                                     temperature=self.opts.eval_temperature, seed=self.opts.seed)


def run_stage(recipe: Recipe, name: str, out_dir: Path, *, registry: Registry, resume: bool = False,
              max_steps: int | None = None, progress: bool = True) -> dict[str, Any]:
    """Run stage ``name`` of ``recipe`` under ``out_dir`` with the specs the recipe names in ``registry`` (the
    plugin host, resolved by the CLI); returns its summary (also written to summary.json).

    Under torchrun (WORLD_SIZE > 1) every rank calls this for a data-parallel stage; rank 0 alone writes."""
    settle_cpu_math()  # before any parallel CPU math: a resumed step equals the uninterrupted run's
    with ExitStack() as cleanup:  # closes what a stage opened (Ray-placed rollout workers), also on error
        # a resume adopts its checkpoint's intra-op thread count for the stage (use_threads_of); the caller's
        # count comes back after it, so a later stage or run in this process starts from its own count
        cleanup.callback(torch.set_num_threads, torch.get_num_threads())
        if launch_rank() == 0:  # one process per run directory (torchrun's other ranks work under rank 0's lock)
            cleanup.enter_context(RunLock(Path(out_dir), f"train {name}"))
        ctx = setup(recipe, name, Path(out_dir), cleanup, registry=registry, resume=resume, progress=progress)
        load_checkpoint(ctx)
        train(ctx, max_steps)
        summary = summarize(ctx)
    ctx.dp.barrier()  # every rank has finished the stage (and rank 0 its files) before any rank moves on
    return summary


# -- phases --------------------------------------------------------------------------------------------------


def setup(recipe: Recipe, name: str, out_dir: Path, cleanup: ExitStack, *, registry: Registry, resume: bool,
          progress: bool) -> StageContext:
    """Options, launch check, binding, warm-start gate, model, optimizer (one group per component), scheduler."""
    if name not in STAGES:
        raise ValueError(f"unknown stage {name!r}; known: {list(STAGES)}")
    entry = STAGES[name]
    opts = checked_options(recipe, name)
    check_trackers(opts.report_to, f"{recipe.where()}: stages.{name}.report_to")
    runner = entry.stage_class()(opts)
    world = launch_world_size()
    if entry.data_parallel:
        check_launch(recipe, name, opts, world)
    elif world > 1:
        raise RecipeError(f"{name} runs in one process (WORLD_SIZE={world} here): only "
                          f"{[s for s, e in STAGES.items() if e.data_parallel]} run data parallel under torchrun; "
                          f"start `stitch train {name}` without torchrun")
    dp = DataParallel.from_env() if entry.data_parallel else DataParallel()
    seed_all(opts.seed)  # torch, python and numpy: a fresh run's generators depend on the seed alone
    session = StitchSession.open(recipe, out_dir, registry, dtype=getattr(torch, opts.dtype), device=dp.device)
    ctx = StageContext(recipe, name, opts, runner, session, dp, cleanup, progress=progress)
    if dp.is_main:
        sweep_partial_steps(ctx.checkpoints)  # a killed checkpoint write's temp dir (we hold the run's lock)
    if resume:
        ctx.resume_from = latest_step_dir(ctx.checkpoints)
        if ctx.resume_from is None:
            raise FileNotFoundError(f"--resume: no checkpoint under {ctx.checkpoints} (no LATEST)")
        verify_checksums(ctx.resume_from)  # before any of its files is read
        check_resumable(ctx.resume_from, _resolved_yaml(recipe), getattr(recipe, "digest", ""),
                        ctx.layout.manifest)
    ctx.warm_start = warm_start_source(session, entry, opts)  # the gate runs before any model weights load
    text = _resolved_yaml(recipe)
    if dp.is_main and text is not None:
        write_text_atomic(ctx.layout.recipe, text)
    if dp.is_main and opts.report_to:
        ctx.trackers = cleanup.enter_context(open_trackers(
            opts.report_to, ctx.layout.stage_dir(name) / "trackers", f"{recipe.name}-{name}", tracker_config(opts),
            resume_step=None if ctx.resume_from is None else step_number(ctx.resume_from)))

    args = runner.model_args()
    if ctx.warm_start is not None:
        args.update({f"{part}_from": ctx.warm_start / part for part in entry.warm_parts})
    ctx.allowed = tuple(g for g, on in (("projector", args.get("train_projector", True)),
                                        ("adapter", "lora" in args or "adapter_from" in args),
                                        ("lm", args.get("full_lm", False))) if on)
    model = ctx.model = build_stage_model(ctx, args)
    # a captured block's graph holds its module, so the model outlives the stage unless its graphs go: a chain's
    # next stage (SFT, then GRPO in one process) would start with this one's weights and graph pools still held
    cleanup.callback(drop_graphs, model)
    checkpoint_layers(model, opts.activation_checkpointing, f"stages.{name}.activation_checkpointing")
    audit_gradients(model, ctx.allowed)
    for group in ctx.allowed:  # one parameter group per component, each with its own learning rate
        params = [p for n, p in model.named_parameters() if p.requires_grad and parameter_group(n) == group]
        if params:
            ctx.groups.append({"params": params, "lr": getattr(opts, f"lr_{group}"), "name": group})
    ctx.optimizer = make_optimizer(ctx.groups, opts.weight_decay)
    ctx.scheduler = torch.optim.lr_scheduler.LambdaLR(ctx.optimizer, lr_lambda(opts))
    runner.build(ctx)
    return ctx


def build_stage_model(ctx: StageContext, args: dict[str, Any]) -> Any:
    """The stage's model from ``args`` (``ModelBinding.build_model``), its training state checked against the device
    memory (``check_memory``): in one process before it is placed on the device; under torchrun FSDP2-sharded."""
    dp, binding = ctx.dp, ctx.binding
    if dp.active and args.get("full_lm"):
        raise RecipeError(f"stages.{ctx.name}.train_lm: full runs in one process (WORLD_SIZE={dp.world_size} here); "
                          f"start `stitch train {ctx.name}` without torchrun, or train_lm: lora")
    if dp.active:  # FSDP2: with parallel.meta_init only rank 0 holds the whole model (docs/scaling.md)
        parallel = getattr(ctx.recipe, "parallel", None)
        model = dp.build_sharded(binding, args, ctx.resume_from, meta_init=parallel.meta_init if parallel else True)
        ctx.memory = check_memory(ctx, model)
        return model
    model = binding.build_model(**args, place=False)
    ctx.memory = check_memory(ctx, model)
    return model.to(binding.device)


def check_memory(ctx: StageContext, model: Any) -> MemoryEstimate:
    """The estimate of the model's training state (weights, gradients, AdamW moments; per rank under FSDP2), shown
    when the stage shows progress; refused with its arithmetic when it exceeds the device memory the stage declares
    (``device_memory_gib``) or, without one, the device's own."""
    est = estimate(model_parts(model.named_parameters()))
    world = ctx.state_ranks
    need = est.total // world
    declared = ctx.opts.device_memory_gib
    field = f"stages.{ctx.name}.device_memory_gib"
    have, what = (int(declared * GIB), field) if declared is not None else device_memory(ctx.session.device)
    state = f"{ctx.name}: training state {gib(need)}{f' per rank of {world}' if world > 1 else ''}"
    tail = f"activations on top; {what}: {gib(have)}"
    if ctx.dp.is_main and ctx.progress:  # the arithmetic goes to summary.json and into a refusal
        print(f"{state}, {tail}", file=sys.stderr)
    if need > have:
        raise TrainingMemoryError(f"{state} ({est.arithmetic()}), {tail}: does not fit. Train fewer weights (sft's train_lm: lora or "
                                  f"train_lm_layers), in bfloat16 (stages.{ctx.name}.dtype), over more GPUs, or "
                                  f"declare the device's real memory in {field}")
    return est


def tracker_config(opts: StageOptions) -> dict[str, Any]:
    """The stage's scalar options, as the parameters a tracker records with the run."""
    return {k: v for k, v in opts.model_dump(mode="json").items() if isinstance(v, str | int | float | bool)}


def _resolved_yaml(recipe: Recipe) -> str | None:
    text = getattr(recipe, "resolved_yaml", None)
    return text() if callable(text) else text


def warm_start_source(session: StitchSession, entry: Any, opts: Any) -> Path | None:
    """The latest checkpoint of the stage ``entry`` warm-starts from, after the provenance gate when it hands
    over an adapter; None for a stage that starts fresh."""
    if entry.warm_start is None:
        return None
    source = getattr(opts, "warm_start", None) or entry.warm_start  # a stage may choose its donor (DPO: sft, grpo)
    root = session.layout.checkpoints(source)
    donor = latest_step_dir(root)
    if donor is None:
        raise FileNotFoundError(
            f"{entry.name} warm-starts from {source}, but {root} has no LATEST; run "
            f"`stitch train {source} --recipe {session.recipe.name} --out {session.out_dir}` first"
        )
    verify_checksums(donor)  # the donor's files are the ones it wrote
    if "adapter" in entry.warm_parts:
        # what this stage restates about the donor's adapter (rank, alpha); by default SFT's, which every later
        # stage carries on
        lora = getattr(opts, "lora", None) or stage_options(session.recipe, entry.warm_start).lora
        check_warm_start(donor, session.binding.warm_start_expectations(lora))
    return donor


def load_checkpoint(ctx: StageContext) -> None:
    """Resume from ``ctx.resume_from``: trainable weights, optimizer, scheduler, torch/python RNG, the stage's
    data state, the step; the metrics log is cut back to that step. A fresh run starts a fresh log."""
    if ctx.resume_from is None:
        if ctx.dp.is_main:
            ctx.metrics.reset()
        return
    step_dir = ctx.resume_from
    verify_checksums(step_dir)  # before any tensor of it is read
    if ctx.dp.active:  # optimizer.pt holds full tensors (one-process layout), whatever world size wrote it
        ctx.dp.load_optimizer_state(ctx.optimizer, torch.load(step_dir / "optimizer.pt", weights_only=True))
    else:
        ctx.binding.load_trainable(ctx.model, step_dir)
    state = load_step_state(step_dir, None if ctx.dp.active else ctx.optimizer)
    ctx.scheduler.load_state_dict(state["scheduler"])
    ctx.runner.load_state_dict(state["data"])
    ctx.step = state["step"]
    if ctx.dp.is_main:
        ctx.metrics.truncate_after(ctx.step)


def train(ctx: StageContext, max_steps: int | None = None) -> None:
    """Steps until ``opts.steps`` (or ``max_steps``): one metrics line per step, evaluation every ``eval_every``,
    a checkpoint every ``save_every`` and at the last step."""
    opts = ctx.opts
    ctx.runner.start(ctx)
    total = opts.steps if max_steps is None else min(opts.steps, max_steps)
    metrics = ctx.metrics
    ctx.model.train()
    ctx.t_start = time.perf_counter()
    bar = progress(total, ctx.name, enabled=ctx.progress and ctx.dp.is_main, initial=ctx.step, dynamic_ncols=True)
    if opts.profile_steps is not None and ctx.dp.is_main:
        ctx.profiler = StepProfiler(opts.profile_steps, ctx.layout.stage_dir(ctx.name) / "profile")
    while ctx.step < total:
        lrs = ctx.scheduler.get_last_lr()  # the rates this step trains with
        if ctx.profiler is not None:
            ctx.profiler.before(ctx.step + 1)
        record = ctx.runner.step(ctx)
        ctx.scheduler.step()
        ctx.step += 1
        if ctx.profiler is not None:
            ctx.profiler.after(ctx.step)
        record = {"step": ctx.step, **record, "grad_norm": ctx.grad_norm,
                  **{f"lr_{g['name']}": lr for g, lr in zip(ctx.groups, lrs, strict=True)}}
        if opts.eval_partition and opts.eval_every and ctx.step % opts.eval_every == 0 and ctx.step < total:
            record["eval_accuracy"] = ctx.evaluate()
        if ctx.dp.is_main:
            metrics.write(record)
        bar.set_postfix({k: f"{record[k]:.3f}" for k in ctx.runner.postfix if k in record})
        bar.update(1)
        if ctx.step % opts.save_every == 0 or ctx.step == total:
            save_checkpoint(ctx)
    bar.close()


def save_checkpoint(ctx: StageContext) -> Path | None:
    """``checkpoints/step_N`` (trainable weights, optimizer, RNG, scheduler, the stage's data state, the recipe
    digest, the warm-start source), then LATEST. Under FSDP every rank gathers; rank 0 writes the one-process
    layout."""
    state = {"scheduler": ctx.scheduler.state_dict(), "data": ctx.runner.state_dict(),
             "recipe_digest": getattr(ctx.recipe, "digest", ""), "data_digest": data_digest(ctx.layout.manifest),
             "warm_start": str(ctx.warm_start) if ctx.warm_start else None, "environment": environment()}
    keep, needed = ctx.opts.keep_checkpoints, checkpoint_bytes(ctx)
    recipe_text = _resolved_yaml(ctx.recipe)
    if not ctx.dp.active:
        def payload(d: Path) -> None:
            ctx.binding.save_trainable(ctx.model, d, ctx.name)
            if recipe_text is not None:
                (d / RECIPE_NAME).write_text(recipe_text)

        return save_step(ctx.checkpoints, ctx.step, payload, ctx.optimizer, state, keep=keep, needed=needed)
    full, optim = ctx.dp.full_trainable_state(ctx.model), ctx.dp.full_optimizer_state(ctx.optimizer)
    if not ctx.dp.is_main:
        return None

    def sharded_payload(d: Path) -> None:
        ctx.binding.save_trainable(ctx.model, d, ctx.name, state=full)
        torch.save(optim, d / "optimizer.pt")
        if recipe_text is not None:
            (d / RECIPE_NAME).write_text(recipe_text)

    return save_step(ctx.checkpoints, ctx.step, sharded_payload, None, state, keep=keep, needed=needed)


def checkpoint_bytes(ctx: StageContext) -> int:
    """A step's size before it is written: the trainable weights and the optimizer's state tensors."""
    weights = sum(p.numel() * p.element_size() for g in ctx.groups for p in g["params"])
    moments = sum(t.numel() * t.element_size() for s in ctx.optimizer.state.values() for t in s.values()
                  if isinstance(t, torch.Tensor))
    return weights + moments


def summarize(ctx: StageContext) -> dict[str, Any]:
    """summary.json: the shared fields, the stage's own, the final evaluation (also logged as a ``final`` line)."""
    elapsed = time.perf_counter() - ctx.t_start
    ctx.dp.barrier()  # rank 0's metrics and checkpoint are complete before any rank reads them
    metrics = ctx.metrics
    history = [r for r in metrics.read() if not r.get("final")]
    losses = [r["loss"] for r in history if "loss" in r]
    summary: dict[str, Any] = {
        "stage": ctx.name,
        "steps": ctx.step,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "trainable_parameters": trainable_by_group(ctx.model),
        "memory_estimate": {"bytes": ctx.memory.total, "arithmetic": ctx.memory.arithmetic()} if ctx.memory else None,
        "memory_held_bytes": ctx.memory_held,
        "peak_memory_bytes": peak_memory_bytes(),
        "checkpoint": str(latest_step_dir(ctx.checkpoints)),
        "metrics": str(metrics.path),
        "seconds": round(elapsed, 2),
        "environment": environment(),
    }
    if ctx.warm_start is not None:
        summary["donor"] = str(ctx.warm_start)
    if ctx.profiler is not None and ctx.profiler.result is not None:
        summary["profile"] = ctx.profiler.result
    summary.update(ctx.runner.summary(ctx, history))
    if ctx.dp.active:
        summary["world_size"] = ctx.dp.world_size
        summary["peak_memory_bytes_per_rank"] = ctx.dp.gather_object(peak_memory_bytes())
    if ctx.opts.eval_partition:
        summary["eval_accuracy"] = ctx.evaluate()
        if ctx.dp.is_main:
            metrics.write({"step": ctx.step, "eval_accuracy": summary["eval_accuracy"], "final": True})
    if ctx.dp.is_main:
        write_text_atomic(ctx.layout.summary(ctx.name), json.dumps(summary, indent=2))
    return summary
