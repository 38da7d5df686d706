"""Alignment and SFT: one self-contained stage runner (setup -> train -> checkpoint -> summary).

alignment trains only the projector against the frozen LM; sft warm-starts the projector from the
alignment artifact and trains it jointly with a LoRA adapter on the model plugin's target set. Under
``torchrun --nproc-per-node N`` the same loop runs FSDP2 data parallel (stitch.stages.distributed): same global
batch, same seed, checkpoints in the one-process layout.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from stitch.config.recipe import Recipe, RecipeError, stage_options
from stitch.data.packing import PackedStream, collate_packs
from stitch.runs.checkpoint import latest_step_dir, load_step_state, save_step, write_text_atomic
from stitch.stages.distributed import DataParallel, launch_world_size, save_trainable_full

TRAIN_STAGES = ("alignment", "sft")


@dataclass(frozen=True)
class StageOptions:
    """Options of one training stage, read from ``recipe.stages[<stage>]``; unknown keys are refused."""

    steps: int = 100
    batch_size: int = 8  # packs (rows) per optimizer step
    token_budget: int = 512  # tokens per pack
    buffer_size: int = 64
    lr_projector: float = 1e-3
    lr_adapter: float = 3e-3
    schedule: str = "cosine"  # cosine | constant
    warmup_steps: int = 0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    save_every: int = 50
    keep_checkpoints: int = 2
    seed: int = 0
    partition: str = "train"
    eval_partition: str | None = "eval"
    eval_rows: int = 64
    eval_every: int = 0  # also evaluate every N steps (0: only at the end); logged as eval_accuracy
    dtype: str = "float32"
    lora: dict[str, Any] = field(default_factory=lambda: {"r": 16, "alpha": 32, "dropout": 0.0})
    packing: bool = True  # the model plugin may still refuse (ModelSpec.supports_packing)
    train_projector: bool = True

    @classmethod
    def from_recipe(cls, recipe: Recipe, stage: str) -> StageOptions:
        opts = stage_options(cls, recipe, stage)
        for key in ("steps", "batch_size", "token_budget", "buffer_size", "save_every"):
            if not isinstance(getattr(opts, key), int) or getattr(opts, key) < 1:
                raise RecipeError(
                    f"recipe {recipe.name!r}: field 'stages.{stage}.{key}': expected a positive integer, "
                    f"got {getattr(opts, key)!r}"
                )
        if opts.schedule not in ("cosine", "constant"):
            raise RecipeError(
                f"recipe {recipe.name!r}: field 'stages.{stage}.schedule': expected cosine or constant, "
                f"got {opts.schedule!r}"
            )
        if opts.dtype not in ("float32", "bfloat16"):
            raise RecipeError(
                f"recipe {recipe.name!r}: field 'stages.{stage}.dtype': expected float32 or bfloat16, got {opts.dtype!r}"
            )
        names = {p.name for p in recipe.data.partitions}
        for key in ("partition", "eval_partition"):
            value = getattr(opts, key)
            if value is not None and value not in names:
                raise RecipeError(
                    f"recipe {recipe.name!r}: field 'stages.{stage}.{key}': expected one of the data partitions "
                    f"{sorted(names)}, got {value!r}"
                )
        return opts

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


log = logging.getLogger("stitch")


def _carries_sample_starts(model: Any) -> bool:
    """Whether a hybrid LM's loader installed the varlen path (``stitch_varlen``) on the wrapped model."""
    return any(getattr(m, "stitch_varlen", False) for m in model.modules())


def lr_lambda(opts: StageOptions):
    def scale(step: int) -> float:
        if opts.warmup_steps and step < opts.warmup_steps:
            return (step + 1) / opts.warmup_steps
        if opts.schedule == "constant":
            return 1.0
        progress = (step - opts.warmup_steps) / max(1, opts.steps - opts.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return scale


def peak_memory_bytes() -> int:
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class MetricsLog:
    """Append-only JSONL of per-step metrics; on resume, lines past the checkpoint step are dropped."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        # a run that stopped at ``step`` (--max-steps) logged its final evaluation there; the resumed run logs its own
        keep = [line for line in self.path.read_text().splitlines()
                if line and json.loads(line)["step"] <= step and not json.loads(line).get("final")]
        write_text_atomic(self.path, "".join(line + "\n" for line in keep))

    def reset(self) -> None:
        self.path.unlink(missing_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line]


def trainable_by_group(model: Any) -> dict[str, int]:
    groups = {"projector": 0, "adapter": 0, "other": 0}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if name.startswith("projector."):
            groups["projector"] += param.numel()
        elif "lora_" in name:
            groups["adapter"] += param.numel()
        else:
            groups["other"] += param.numel()
    return groups


def audit_gradients(model: Any, allowed: tuple[str, ...]) -> None:
    """Fail closed if any parameter outside the allowed groups is trainable or received a gradient."""
    offenders = []
    for name, param in model.named_parameters():
        group = "projector" if name.startswith("projector.") else "adapter" if "lora_" in name else "other"
        if group not in allowed and (param.requires_grad or param.grad is not None):
            offenders.append(name)
    if offenders:
        raise RuntimeError(
            f"parameters outside {allowed} would train: {offenders[:5]}{' ...' if len(offenders) > 5 else ''}"
        )


def train_stage(
    recipe: Recipe,
    stage: str,
    out_dir: Path,
    *,
    resume: bool = False,
    max_steps: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run ``stage`` (alignment | sft) of ``recipe`` under ``out_dir``; returns the stage summary.

    Under torchrun (WORLD_SIZE > 1) every rank calls this; rank 0 alone writes metrics, checkpoints and the
    summary."""
    from stitch.config.validate import check_launch

    if stage not in TRAIN_STAGES:
        raise ValueError(f"train_stage runs {TRAIN_STAGES}, not {stage!r}")
    check_launch(recipe, stage, StageOptions.from_recipe(recipe, stage), launch_world_size())
    dp = DataParallel.from_env()
    summary = _train_stage(recipe, stage, out_dir, dp, resume=resume, max_steps=max_steps, progress=progress)
    dp.barrier()  # every rank has finished the stage (and rank 0 its files) before any rank moves on
    return summary


def _train_stage(
    recipe: Recipe, stage: str, out_dir: Path, dp: DataParallel, *, resume: bool, max_steps: int | None,
    progress: bool,
) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from stitch.stages.session import StitchSession

    opts = StageOptions.from_recipe(recipe, stage)
    out_dir = Path(out_dir)
    stage_dir = out_dir / stage
    ckpt_root = stage_dir / "checkpoints"
    metrics = MetricsLog(stage_dir / "metrics.jsonl")
    resume_dir = latest_step_dir(ckpt_root) if resume else None
    if resume and resume_dir is None:
        raise FileNotFoundError(f"--resume: no checkpoint under {ckpt_root} (no LATEST)")

    torch.manual_seed(opts.seed)
    session = StitchSession.open(recipe, out_dir, dtype=opts.torch_dtype, device=dp.device)
    warm = None
    if stage == "sft":
        warm = latest_step_dir(out_dir / "alignment" / "checkpoints")
        if warm is None:
            raise FileNotFoundError(
                f"sft warm-starts the projector from alignment, but {out_dir / 'alignment' / 'checkpoints'} has "
                f"no LATEST; run `stitch train alignment` first"
            )
    model = session.build_model(
        stage=stage,
        lora=opts.lora if stage == "sft" else None,
        projector_from=warm / "projector" if warm else None,
        train_projector=opts.train_projector,
    )
    if dp.active:
        if resume_dir is not None:  # full tensors into the plain module; sharding then splits them
            session.load_trainable(model, resume_dir)
        model = dp.shard(model)
    allowed = ("projector",) if stage == "alignment" else ("projector", "adapter")
    audit_gradients(model, allowed)
    groups = []
    proj_params = [p for p in model.projector.parameters() if p.requires_grad]
    if proj_params:
        groups.append({"params": proj_params, "lr": opts.lr_projector, "name": "projector"})
    adapter_params = [p for n, p in model.named_parameters() if p.requires_grad and "lora_" in n]
    if adapter_params:
        groups.append({"params": adapter_params, "lr": opts.lr_adapter, "name": "adapter"})
    optimizer = torch.optim.AdamW(groups, weight_decay=opts.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(opts))

    packed = opts.packing and session.model_spec.packs()
    if packed and not session.model_spec.supports_packing and not _carries_sample_starts(model):
        # the binding packs only when its loader wired sample boundaries into the model; it did not here
        log.warning("%s: packing is available on this machine but the loaded model has no sample-boundary path "
                    "(stitch_varlen); training unpacked", session.model_spec.name)
        packed = False
    stream = PackedStream(
        session.manifest_path,
        session.make_sample,
        token_budget=opts.token_budget,
        buffer_size=opts.buffer_size,
        seed=opts.seed,
        pack=packed,
        rows=lambda row: row["partition"] == opts.partition,
    )
    step = 0
    if resume_dir is not None:
        if dp.active:  # optimizer.pt holds full tensors (one-process layout), whatever world size wrote it
            dp.load_optimizer_state(optimizer, torch.load(resume_dir / "optimizer.pt", weights_only=True))
        else:
            session.load_trainable(model, resume_dir)
        state = load_step_state(resume_dir, None if dp.active else optimizer)
        scheduler.load_state_dict(state["scheduler"])
        stream.load_state_dict(state["data"])
        step = state["step"]
        if dp.is_main:
            metrics.truncate_after(step)
    elif dp.is_main:
        metrics.reset()

    total = opts.steps if max_steps is None else min(opts.steps, max_steps)
    model.train()
    tokens_seen, t_start = 0, time.perf_counter()
    bar = tqdm(total=total, initial=step, desc=stage, disable=not (progress and dp.is_main), dynamic_ncols=True)

    def save(at_step: int) -> Path | None:
        if dp.active:  # every rank gathers; rank 0 writes the same files a one-process run writes
            full, optim = dp.full_trainable_state(model), dp.full_optimizer_state(optimizer)
            if not dp.is_main:
                return None

            def payload(d: Path) -> None:
                save_trainable_full(session, model, d, stage, full)
                torch.save(optim, d / "optimizer.pt")

            return save_step(
                ckpt_root, at_step, payload, None,
                {"scheduler": scheduler.state_dict(), "data": stream.state_dict(), "recipe_digest": recipe.digest},
                keep=opts.keep_checkpoints,
            )
        return save_step(
            ckpt_root,
            at_step,
            lambda d: session.save_trainable(model, d, stage=stage),
            optimizer,
            {"scheduler": scheduler.state_dict(), "data": stream.state_dict(), "recipe_digest": recipe.digest},
            keep=opts.keep_checkpoints,
        )

    while step < total:
        t0 = time.perf_counter()
        packs = [stream.next_pack() for _ in range(opts.batch_size)]  # the global batch, on every rank
        batch = collate_packs(dp.rows(packs), session.pad_id, packed, length=opts.token_budget if packed else None)
        batch = batch.to(session.device)
        loss, n_labels = model.loss(batch)
        loss_value, tokens = float(loss.detach()), batch.tokens
        objective = loss
        if dp.active:
            # normalise by the global label count; the gradient reduce-scatter averages over ranks, hence
            # x world: the averaged gradient is the one-process gradient of the whole batch
            loss_sum, n_global, tokens = dp.all_sum([loss_value * n_labels, n_labels, batch.tokens])
            objective = loss * (n_labels * dp.world_size / max(n_global, 1.0))
            loss_value, n_labels, tokens = loss_sum / max(n_global, 1.0), int(n_global), int(tokens)
        optimizer.zero_grad(set_to_none=True)
        objective.backward()
        if step == 0 or resume_dir is not None:
            audit_gradients(model, allowed)
            resume_dir = None
        grad_norm = dp.clip_grad_norm([p for g in groups for p in g["params"]], opts.grad_clip)
        optimizer.step()
        scheduler.step()
        step += 1
        dt = time.perf_counter() - t0
        tokens_seen += tokens
        fill = tokens / (len(packs) * opts.token_budget) if packed else 1.0
        record = {
            "step": step,
            "loss": loss_value,
            "grad_norm": float(grad_norm),
            "tokens": tokens,
            "label_tokens": n_labels,
            "pack_fill": round(fill, 4),
            "tokens_per_s": round(tokens / dt, 1),
            **{f"lr_{g['name']}": scheduler.get_last_lr()[i] for i, g in enumerate(groups)},
        }
        if opts.eval_partition and opts.eval_every and step % opts.eval_every == 0 and step < total:
            from stitch.stages.evaluation import evaluate_accuracy

            with dp.full_parameters(model):
                record["eval_accuracy"] = evaluate_accuracy(session, model, opts.eval_partition, limit=opts.eval_rows)
        if dp.is_main:
            metrics.write(record)
        bar.set_postfix(loss=f"{record['loss']:.3f}", fill=f"{fill:.2f}")
        bar.update(1)
        if step % opts.save_every == 0 or step == total:
            save(step)
    bar.close()
    elapsed = time.perf_counter() - t_start
    dp.barrier()  # rank 0's metrics and checkpoint are complete before any rank reads them
    history = metrics.read()
    summary = {
        "stage": stage,
        "steps": step,
        "loss_first": history[0]["loss"] if history else None,
        "loss_last": history[-1]["loss"] if history else None,
        "tokens_per_s": round(tokens_seen / elapsed, 1) if elapsed > 0 else None,
        "trainable_parameters": trainable_by_group(model),
        "packed": packed,
        "mean_pack_fill": round(sum(r["pack_fill"] for r in history) / len(history), 4) if history else None,
        "peak_memory_bytes": peak_memory_bytes(),
        "checkpoint": str(latest_step_dir(ckpt_root)),
        "metrics": str(metrics.path),
        "seconds": round(elapsed, 2),
    }
    if dp.active:
        summary["world_size"] = dp.world_size
        summary["peak_memory_bytes_per_rank"] = dp.gather_object(peak_memory_bytes())
    if opts.eval_partition:
        from stitch.stages.evaluation import evaluate_accuracy

        with dp.full_parameters(model):
            summary["eval_accuracy"] = evaluate_accuracy(session, model, opts.eval_partition, limit=opts.eval_rows)
        if dp.is_main:
            metrics.write({"step": step, "eval_accuracy": summary["eval_accuracy"], "final": True})
    if dp.is_main:
        write_text_atomic(stage_dir / "summary.json", json.dumps(summary, indent=2))
    return summary
