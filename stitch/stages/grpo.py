"""GRPO: warm start from SFT behind the provenance gate, group sampling from a rollout engine, verifiable
reward, group-normalised advantages, clipped policy loss and a KL leash to the SFT reference.

Only the adapter trains by default; ``train_projector: true`` adds the projector as its own parameter
group (constant LR only), logs its relative-L2 drift before every update, and anchors the KL reference to
the warm-start projector.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.func import functional_call

from stitch.config.recipe import Recipe, RecipeError, stage_options
from stitch.data.packing import Sample, collate_packs
from stitch.rollout.engines import mask_suppressed
from stitch.runs.checkpoint import (
    latest_step_dir,
    load_step_state,
    random_from_json,
    random_to_json,
    save_step,
    write_text_atomic,
)
from stitch.stages.evaluation import evaluate_accuracy
from stitch.stages.supervised import MetricsLog, audit_gradients, peak_memory_bytes, trainable_by_group


@dataclass(frozen=True)
class GRPOOptions:
    steps: int = 20
    prompts_per_step: int = 8
    group_size: int = 4
    max_new_tokens: int = 10
    temperature: float = 1.0
    lr_adapter: float = 1e-4
    lr_projector: float = 1e-5
    schedule: str = "constant"
    clip_eps: float = 0.2
    kl_beta: float = 0.04
    updates_per_batch: int = 1
    # sequences per forward/backward (gradients accumulate to the same update); None = the whole step at once
    micro_batch_size: int | None = None
    train_projector: bool = False
    engine: str = "embedded"
    placement: str = "colocated"  # or "ray": rollout replicas as Ray actors (stitch.rollout.ray_rollout)
    partition: str = "grpo"
    eval_partition: str | None = "eval"
    eval_rows: int = 64
    save_every: int = 10
    seed: int = 0
    lora: dict[str, Any] | None = None  # must restate the SFT donor's rank and alpha

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> GRPOOptions:
        opts = stage_options(cls, recipe, "grpo")
        if opts.train_projector and opts.schedule != "constant":
            raise RecipeError(
                f"recipe {recipe.name!r}: field 'stages.grpo.schedule': the trainable-projector variant needs a "
                f"constant LR schedule (a warm start's projector group must not be rescaled), got {opts.schedule!r}"
            )
        if opts.schedule not in ("constant", "cosine"):
            raise RecipeError(f"recipe {recipe.name!r}: field 'stages.grpo.schedule': expected constant or cosine, "
                              f"got {opts.schedule!r}")
        if opts.placement not in ("colocated", "ray"):
            raise RecipeError(f"recipe {recipe.name!r}: field 'stages.grpo.placement': expected colocated or ray, "
                              f"got {opts.placement!r}")
        if opts.micro_batch_size is not None and (not isinstance(opts.micro_batch_size, int)
                                                   or opts.micro_batch_size < 1):
            raise RecipeError(f"recipe {recipe.name!r}: field 'stages.grpo.micro_batch_size': expected a positive "
                              f"integer or null, got {opts.micro_batch_size!r}")
        if opts.group_size < 2:
            raise RecipeError(f"recipe {recipe.name!r}: field 'stages.grpo.group_size': expected at least 2 "
                              f"(advantages are normalised within a group), got {opts.group_size}")
        return opts


def reward(completion_text: str, gold_answer: str) -> float:
    """The counting demo's reward (kept for its tests; training calls the recipe's task)."""
    from stitch.demo.counting import counting_reward
    from stitch.plugins.specs import TaskRow

    return counting_reward(completion_text, TaskRow("", "", gold_answer))


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    groups = rewards.view(-1, group_size)
    adv = (groups - groups.mean(dim=1, keepdim=True)) / (groups.std(dim=1, keepdim=True) + eps)
    return adv.view(-1)


def token_logprobs(model: Any, batch: Any, temperature: float, params: dict[str, torch.Tensor] | None = None,
                   suppress_ids: Sequence[int] = ()):
    """Log-probs of each label token under ``model`` (or under ``params`` substituted into it), over the
    same distribution the engine samples from (suppressed ids masked)."""
    logits = model.logits(batch) if params is None else _logits_with(model, params, batch)
    logits = mask_suppressed(logits[:, :-1].float(), suppress_ids) / temperature
    target = batch.labels[:, 1:]
    mask = target != -100
    lp = torch.log_softmax(logits, dim=-1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return lp, mask


def _logits_with(model: Any, params: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
    """Logits with ``params`` (e.g. the reference adapter and projector) substituted for the live ones."""
    return functional_call(model, params, (batch,), strict=False)


def grpo_loss(lp: torch.Tensor, old_lp: torch.Tensor, ref_lp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
              clip_eps: float, kl_beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped surrogate minus k3 KL to the reference, per-sequence token mean, batch mean; returns (loss, kl)."""
    ratio = torch.exp(lp - old_lp)
    a = adv.unsqueeze(1)
    surrogate = torch.min(ratio * a, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * a)
    kl = torch.exp(ref_lp - lp) - (ref_lp - lp) - 1
    per_token = -(surrogate - kl_beta * kl)
    per_seq = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)
    return per_seq.mean(), kl


def micro_batches(samples: list[list[Sample]], pad_id: int, size: int | None,
                  device: torch.device | str) -> tuple[list[range], list[Any]]:
    """The step's sequences as padded batches of at most ``size`` rows (None: one batch), all one width."""
    width = max(len(pack[0]) for pack in samples)
    size = size or len(samples)
    chunks = [range(i, min(i + size, len(samples))) for i in range(0, len(samples), size)]
    batches = [collate_packs([samples[i] for i in chunk], pad_id, packed=False, length=width).to(device)
               for chunk in chunks]
    return chunks, batches


def _same(batch: Any) -> Any:
    return batch


@torch.no_grad()
def score_rollouts(model: Any, batches: list[Any], temperature: float, reference_params: dict[str, torch.Tensor],
                   suppress_ids: Sequence[int], prepare: Callable[[Any], Any] = _same):
    """(old log-probs, reference log-probs, completion mask) over all micro-batches. ``prepare`` may rewrite a
    batch before each forward (the encoder-in-the-loop benchmark baseline re-encodes its images there)."""
    old = [token_logprobs(model, prepare(b), temperature, suppress_ids=suppress_ids) for b in batches]
    ref = [token_logprobs(model, prepare(b), temperature, params=reference_params, suppress_ids=suppress_ids)[0]
           for b in batches]
    return torch.cat([lp for lp, _ in old]), torch.cat(ref), torch.cat([m for _, m in old])


def engine_parity(completions: Sequence[Any], old_lp: torch.Tensor, mask: torch.Tensor) -> float:
    """Largest gap between the engine's log-prob of a sampled token and the training forward's."""
    engine_lp = torch.zeros_like(old_lp)
    for i, c in enumerate(completions):
        pos = mask[i].nonzero().squeeze(-1)
        engine_lp[i, pos] = torch.tensor(c.logprobs, device=old_lp.device, dtype=engine_lp.dtype)
    return float((engine_lp - old_lp)[mask].abs().max()) if mask.any() else 0.0


def policy_update(model: Any, optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]],
                  allowed: tuple[str, ...], chunks: list[range], batches: list[Any], old_lp: torch.Tensor,
                  ref_lp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, opts: GRPOOptions,
                  suppress_ids: Sequence[int], prepare: Callable[[Any], Any] = _same) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over all micro-batches, gradients accumulated; returns (loss, per-token kl)."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    total = chunks[-1].stop
    loss, kls = torch.zeros((), device=old_lp.device), []
    for chunk, b in zip(chunks, batches, strict=True):
        part = slice(chunk.start, chunk.stop)
        lp, _ = token_logprobs(model, prepare(b), opts.temperature, suppress_ids=suppress_ids)
        chunk_loss, chunk_kl = grpo_loss(lp, old_lp[part], ref_lp[part], adv[part], mask[part], opts.clip_eps,
                                         opts.kl_beta)
        # the step's loss is a mean over sequences: weight each chunk by its share of them
        weighted = chunk_loss * (len(chunk) / total)
        weighted.backward()
        loss, kls = loss + weighted.detach(), kls + [chunk_kl.detach()]
    audit_gradients(model, allowed)
    torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], 1.0)
    optimizer.step()
    return loss, torch.cat(kls)


def projector_drift(projector: torch.nn.Module, anchor: dict[str, torch.Tensor]) -> float:
    num = sum(float((p.detach() - anchor[n]).pow(2).sum()) for n, p in projector.named_parameters())
    den = sum(float(anchor[n].pow(2).sum()) for n, _ in projector.named_parameters())
    return (num / max(den, 1e-30)) ** 0.5


def train_grpo(recipe: Recipe, out_dir: Path, *, resume: bool = False, max_steps: int | None = None,
               progress: bool = True) -> dict[str, Any]:
    with ExitStack() as cleanup:  # closes Ray-placed rollout workers at the end and on error
        return _train_grpo(recipe, out_dir, cleanup, resume=resume, max_steps=max_steps, progress=progress)


def _train_grpo(recipe: Recipe, out_dir: Path, cleanup: ExitStack, *, resume: bool, max_steps: int | None,
                progress: bool) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from stitch.stages.session import StitchSession

    opts = GRPOOptions.from_recipe(recipe)
    out_dir = Path(out_dir)
    stage_dir = out_dir / "grpo"
    ckpt_root = stage_dir / "checkpoints"
    session = StitchSession.open(recipe, out_dir)
    # the gate runs before any model weights load
    donor = session.checked_sft_donor("grpo", opts.lora)
    torch.manual_seed(opts.seed)
    resume_dir = latest_step_dir(ckpt_root) if resume else None
    model = session.build_model(stage="grpo", adapter_from=donor / "adapter", projector_from=donor / "projector",
                                train_projector=opts.train_projector)
    allowed = ("projector", "adapter") if opts.train_projector else ("adapter",)
    audit_gradients(model, allowed)
    # reference = the warm start: SFT adapter and SFT projector, frozen copies substituted at call time
    reference = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    anchor = {n: p.detach().clone() for n, p in model.projector.named_parameters()}
    groups = [{"params": [p for n, p in model.named_parameters() if p.requires_grad and "lora_" in n],
               "lr": opts.lr_adapter, "name": "adapter"}]
    if opts.train_projector:
        groups.append({"params": list(model.projector.parameters()), "lr": opts.lr_projector, "name": "projector"})
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    sentinels = list(session.sentinel_ids.as_dict().values())
    engine_spec = session.host.get("rollout_engines", opts.engine)
    rows = list(session.data.rows(opts.partition))
    from stitch.tasks import resolve_task

    task = resolve_task(recipe, session.host)
    rows = [r for r in rows if task.takes(r.task_row())]
    if not rows:
        raise ValueError(f"grpo: partition {opts.partition!r} has no rows that task {task.name!r} can reward")
    rng = random.Random(opts.seed)
    metrics = MetricsLog(stage_dir / "metrics.jsonl")
    step = 0
    if resume_dir is not None:
        session.load_trainable(model, resume_dir)
        state = load_step_state(resume_dir, optimizer)
        random_from_json(rng, state["data_rng"])
        step = state["step"]
        metrics.truncate_after(step)
    else:
        metrics.reset()
    # built after a resume has restored the adapter: engines holding their own weights start from the live policy
    if opts.placement == "ray":
        from stitch.rollout.ray_rollout import RayRolloutEngine

        engine = RayRolloutEngine.for_recipe(
            recipe, model.lm, engine=opts.engine, model=session.model_spec.name, pad_id=session.pad_id,
            eos_id=session.tokenizer.eos_token_id, suppress_ids=sentinels, seed=opts.seed)
        cleanup.callback(engine.close)
    else:
        engine = engine_spec.factory(model.lm, pad_id=session.pad_id, eos_id=session.tokenizer.eos_token_id,
                                     suppress_ids=sentinels)
    start_accuracy = None
    if opts.eval_partition and step == 0:
        start_accuracy = evaluate_accuracy(session, model, opts.eval_partition, limit=opts.eval_rows)
    total = opts.steps if max_steps is None else min(opts.steps, max_steps)
    bar = tqdm(total=total, initial=step, desc="grpo", disable=not progress, dynamic_ncols=True)
    t_start = time.perf_counter()
    timings = {"rollout": 0.0, "logprobs": 0.0, "train": 0.0, "refit": 0.0}
    while step < total:
        drawn = [rows[rng.randrange(len(rows))] for _ in range(opts.prompts_per_step)]
        t0 = time.perf_counter()
        model.eval()
        with torch.no_grad():
            prompts, feats = [], []
            for row in drawn:
                ids = session.prompt_ids(row.question, row.num_items)
                f = session.data.features(row)
                prompts.append((ids, f))
                emb = model.embed(torch.tensor([ids], device=session.device), f.to(session.device), [row.id])[0]
                feats.append(emb)
            completions = engine.generate(feats, opts.group_size, opts.max_new_tokens, opts.temperature)
        timings["rollout"] += time.perf_counter() - t0
        texts = session.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        rewards = torch.tensor([task.reward(t, drawn[c.prompt_index].task_row()) for t, c in zip(texts, completions, strict=True)])
        adv = group_advantages(rewards, opts.group_size).to(session.device)
        samples = []
        for c in completions:
            ids, f = prompts[c.prompt_index]
            samples.append([Sample(drawn[c.prompt_index].id, ids + c.token_ids, [-100] * len(ids) + c.token_ids, f)])
        chunks, batches = micro_batches(samples, session.pad_id, opts.micro_batch_size, session.device)
        t1 = time.perf_counter()
        reference_params = {**reference, **{f"projector.{n}": t for n, t in anchor.items()}}
        old_lp, ref_lp, mask = score_rollouts(model, batches, opts.temperature, reference_params, sentinels)
        parity = engine_parity(completions, old_lp, mask)
        timings["logprobs"] += time.perf_counter() - t1
        drift = projector_drift(model.projector, anchor) if opts.train_projector else None
        t2 = time.perf_counter()
        for _ in range(opts.updates_per_batch):
            loss, kl = policy_update(model, optimizer, groups, allowed, chunks, batches, old_lp, ref_lp, adv, mask,
                                     opts, sentinels)
        timings["train"] += time.perf_counter() - t2
        t3 = time.perf_counter()
        engine.refit(None)
        timings["refit"] += time.perf_counter() - t3
        step += 1
        mean_kl = float((kl * mask).sum() / mask.sum().clamp(min=1))
        record = {"step": step, "reward": float(rewards.mean()), "loss": float(loss), "kl": mean_kl,
                  "parity_max_abs_logprob": parity,
                  "completion_tokens": int(mask.sum())}
        if drift is not None:
            record["projector_drift"] = drift
        metrics.write(record)
        bar.set_postfix(reward=f"{record['reward']:.2f}", kl=f"{mean_kl:.3f}")
        bar.update(1)
        if step % opts.save_every == 0 or step == total:
            save_step(ckpt_root, step, lambda d: session.save_trainable(model, d, stage="grpo"), optimizer,
                      {"data_rng": random_to_json(rng), "donor": str(donor), "recipe_digest": recipe.digest})
    bar.close()
    history = metrics.read()
    k = max(1, len(history) // 4)
    summary = {
        "stage": "grpo",
        "steps": step,
        "engine": opts.engine,
        "placement": opts.placement,
        "donor": str(donor),
        "reward_start": sum(r["reward"] for r in history[:k]) / k if history else None,
        "reward_end": sum(r["reward"] for r in history[-k:]) / k if history else None,
        "trainable_parameters": trainable_by_group(model),
        "seconds_by_part": {k2: round(v, 2) for k2, v in timings.items()},
        "parity_max_abs_logprob": max((r["parity_max_abs_logprob"] for r in history), default=None),
        "peak_memory_bytes": peak_memory_bytes(),
        "checkpoint": str(latest_step_dir(ckpt_root)),
        "metrics": str(metrics.path),
        "seconds": round(time.perf_counter() - t_start, 2),
    }
    if start_accuracy is not None:
        summary["eval_accuracy_start"] = start_accuracy
    if opts.eval_partition:
        summary["eval_accuracy"] = evaluate_accuracy(session, model, opts.eval_partition, limit=opts.eval_rows)
    write_text_atomic(stage_dir / "summary.json", json.dumps(summary, indent=2))
    return summary

