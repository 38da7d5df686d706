"""DPO on deterministic pairs from the manifest: the recorded answer is chosen; the rejected answer comes from
the recipe's task (its generator) or from the dataset's ``rejected`` column.

Features attach independently to both branches (each branch's placeholder count is checked against its
features); the reference is the SFT warm start (adapter + projector), frozen.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from stitch.config.recipe import Recipe, stage_options
from stitch.data.packing import Sample, collate_packs
from stitch.model.scatter import PlaceholderCountError
from stitch.runs.checkpoint import (
    latest_step_dir,
    load_step_state,
    random_from_json,
    random_to_json,
    save_step,
    write_text_atomic,
)
from stitch.stages.evaluation import evaluate_accuracy
from stitch.stages.grpo import _logits_with
from stitch.stages.supervised import MetricsLog, audit_gradients, peak_memory_bytes, trainable_by_group


@dataclass(frozen=True)
class DPOOptions:
    steps: int = 20
    pairs_per_step: int = 8
    beta: float = 0.1
    lr_adapter: float = 5e-4
    partition: str = "train"
    eval_partition: str | None = "eval"
    eval_rows: int = 64
    save_every: int = 10
    seed: int = 0
    probe_pairs: int = 32  # fixed pairs scored before and after training

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> DPOOptions:
        return stage_options(cls, recipe, "dpo")


def preference_pairs(rows: list[Any], task: Any, seed: int = 0) -> list[dict[str, Any]]:
    """Deterministic pairs: chosen = the recorded answer, rejected = the task's generator (seeded) or the row's
    ``rejected`` column; rows the task does not take, or without a rejected answer, are left out."""
    rng = random.Random(seed)
    pairs = []
    for row in rows:
        task_row = row.task_row()
        if not task.takes(task_row):
            continue
        rejected = task.rejected(task_row, rng) if task.rejected is not None else row.extra.get("rejected")
        if rejected is None:
            continue
        pairs.append({"row": row, "chosen": row.answer, "rejected": rejected})
    return pairs


def branch_sample(session: Any, row: Any, answer: str, features: torch.Tensor) -> Sample:
    from stitch.data.collator import tokenize_example

    messages = list(row.messages[:-1]) + [{"role": "assistant", "content": answer}]
    tokens = session.encoder_spec.tokens_per_item
    ids, labels = tokenize_example(session.tokenizer, messages, session.sentinel_ids, tokens,
                                   row.num_items, row_id=row.id)
    placeholders = ids.count(session.sentinel_ids.placeholder)
    if placeholders != features.shape[0] * tokens:
        raise PlaceholderCountError(
            f"row {row.id!r}: DPO branch {answer!r} has {placeholders} placeholders but its features carry "
            f"{features.shape[0]} items x {tokens} tokens = {features.shape[0] * tokens}"
        )
    return Sample(row.id, ids, labels, features)


def sequence_logprob(model: Any, batch: Any, params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    logits = model.logits(batch) if params is None else _logits_with(model, params, batch)
    logits = logits[:, :-1].float()
    target = batch.labels[:, 1:]
    mask = target != -100
    lp = torch.log_softmax(logits, -1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (lp * mask).sum(1)


def pair_batch(session: Any, pairs: list[dict[str, Any]]) -> Any:
    """Chosen branches then rejected branches, unpacked, each with its own copy of the row's features."""
    chosen, rejected = [], []
    for pair in pairs:
        feats = session.data.features(pair["row"])
        chosen.append([branch_sample(session, pair["row"], pair["chosen"], feats.clone())])
        rejected.append([branch_sample(session, pair["row"], pair["rejected"], feats.clone())])
    return collate_packs(chosen + rejected, session.pad_id, packed=False).to(session.device)


@torch.no_grad()
def pair_metrics(model: Any, session: Any, pairs: list[dict[str, Any]], reference: dict[str, torch.Tensor],
                 beta: float, chunk: int = 16) -> dict[str, float]:
    """Mean DPO loss and chosen-minus-rejected margin over a fixed set of pairs."""
    losses, margins = [], []
    for i in range(0, len(pairs), chunk):
        part = pairs[i : i + chunk]
        batch = pair_batch(session, part)
        ref = sequence_logprob(model, batch, params=reference)
        pol = sequence_logprob(model, batch)
        n = len(part)
        margin = (pol[:n] - ref[:n]) - (pol[n:] - ref[n:])
        losses.append(-F.logsigmoid(beta * margin))
        margins.append(margin)
    return {"loss": float(torch.cat(losses).mean()), "margin": float(torch.cat(margins).mean())}


def train_dpo(recipe: Recipe, out_dir: Path, *, resume: bool = False, max_steps: int | None = None,
              progress: bool = True) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from stitch.stages.session import StitchSession

    opts = DPOOptions.from_recipe(recipe)
    out_dir = Path(out_dir)
    stage_dir = out_dir / "dpo"
    ckpt_root = stage_dir / "checkpoints"
    session = StitchSession.open(recipe, out_dir)
    donor = session.checked_sft_donor("dpo")
    torch.manual_seed(opts.seed)
    model = session.build_model(stage="dpo", adapter_from=donor / "adapter", projector_from=donor / "projector",
                                train_projector=False)
    audit_gradients(model, ("adapter",))
    reference = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=opts.lr_adapter, weight_decay=0.0)
    from stitch.tasks import resolve_task

    task = resolve_task(recipe, session.host)
    pairs = preference_pairs(list(session.data.rows(opts.partition)), task, opts.seed)
    if not pairs:
        raise ValueError(f"dpo: partition {opts.partition!r} has no rows that task {task.name!r} can pair (no "
                         f"rejected answer from the task's generator or the data.columns.rejected column)")
    rng = random.Random(opts.seed)
    metrics = MetricsLog(stage_dir / "metrics.jsonl")
    step = 0
    resume_dir = latest_step_dir(ckpt_root) if resume else None
    if resume_dir is not None:
        session.load_trainable(model, resume_dir)
        state = load_step_state(resume_dir, optimizer)
        random_from_json(rng, state["data_rng"])
        step = state["step"]
        metrics.truncate_after(step)
    else:
        metrics.reset()
    total = opts.steps if max_steps is None else min(opts.steps, max_steps)
    probe = pairs[: opts.probe_pairs]
    model.eval()
    start = pair_metrics(model, session, probe, reference, opts.beta)
    model.train()
    bar = tqdm(total=total, initial=step, desc="dpo", disable=not progress, dynamic_ncols=True)
    t_start = time.perf_counter()
    model.train()
    while step < total:
        drawn = [pairs[rng.randrange(len(pairs))] for _ in range(opts.pairs_per_step)]
        # each branch carries its own copy of the features; its placeholders are checked against them
        batch = pair_batch(session, drawn)
        with torch.no_grad():
            ref = sequence_logprob(model, batch, params=reference)
        pol = sequence_logprob(model, batch)
        n = len(drawn)
        logits = opts.beta * ((pol[:n] - ref[:n]) - (pol[n:] - ref[n:]))
        loss = -F.logsigmoid(logits).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        audit_gradients(model, ("adapter",))
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        margin = float(((pol[:n] - ref[:n]) - (pol[n:] - ref[n:])).detach().mean())
        record = {"step": step, "loss": float(loss.detach()), "margin": margin,
                  "chosen_logprob": float(pol[:n].detach().mean()), "rejected_logprob": float(pol[n:].detach().mean()),
                  "accuracy": float((logits.detach() > 0).float().mean())}
        metrics.write(record)
        bar.set_postfix(loss=f"{record['loss']:.3f}", margin=f"{margin:.2f}")
        bar.update(1)
        if step % opts.save_every == 0 or step == total:
            save_step(ckpt_root, step, lambda d: session.save_trainable(model, d, stage="dpo"), optimizer,
                      {"data_rng": random_to_json(rng), "donor": str(donor)})
    bar.close()
    history = metrics.read()
    model.eval()
    end = pair_metrics(model, session, probe, reference, opts.beta)
    summary = {
        "stage": "dpo", "steps": step, "donor": str(donor),
        # on a fixed probe set of pairs: at the start the policy equals the reference (loss = log 2, margin 0)
        "probe_pairs": len(probe),
        "probe_loss_start": start["loss"], "probe_loss_end": end["loss"],
        "probe_margin_start": start["margin"], "probe_margin_end": end["margin"],
        "loss_first": history[0]["loss"] if history else None,
        "loss_last": history[-1]["loss"] if history else None,
        "margin_first": history[0]["margin"] if history else None,
        "margin_last": history[-1]["margin"] if history else None,
        "trainable_parameters": trainable_by_group(model),
        "peak_memory_bytes": peak_memory_bytes(),
        "checkpoint": str(latest_step_dir(ckpt_root)), "metrics": str(metrics.path),
        "seconds": round(time.perf_counter() - t_start, 2),
    }
    if opts.eval_partition:
        model.eval()
        summary["eval_accuracy"] = evaluate_accuracy(session, model, opts.eval_partition, limit=opts.eval_rows)
    write_text_atomic(stage_dir / "summary.json", json.dumps(summary, indent=2))
    return summary
