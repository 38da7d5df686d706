"""DPO step on chosen/rejected pairs: chosen is the recorded answer; rejected comes from the recipe task's
generator (``TaskSpec.rejected``) or, for a task without one, from the dataset's ``rejected`` column.

Features attach independently to both branches (each branch's placeholder count is checked against its
features); the reference is the SFT warm start (adapter + projector), frozen.
"""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.nn.functional as F

from stitch.data.collator import tokenize_example
from stitch.data.mixture import Mixture
from stitch.data.packing import Sample, collate_packs
from stitch.model.scatter import PlaceholderCountError
from stitch.runs.checkpoint import random_from_json, random_to_json
from stitch.stages.logprobs import sequence_logprob
from stitch.stages.loop import Stage, StageContext
from stitch.tasks import resolve_task


def preference_pairs(task: Any, rows: list[Any], rng: random.Random, partition: str) -> tuple[list[dict[str, Any]], int]:
    """(pairs, rows skipped): chosen = the row's answer; rejected = ``task.rejected(row, rng)`` when the task
    generates one, else the row's ``rejected`` column. A row with neither is skipped; no pair at all is an error."""
    pairs, skipped = [], 0
    for row in rows:
        task_row = row.task_row()
        rejected = task.rejected(task_row, rng) if task.rejected is not None else row.extra.get("rejected")
        if not rejected:
            skipped += 1
            continue
        pairs.append({"row": row, "chosen": row.answer, "rejected": rejected})
    if not pairs:
        source = (f"task {task.name!r} generated no rejected answer" if task.rejected is not None else
                  f"task {task.name!r} has no rejected-answer generator and no row has a 'rejected' column "
                  f"(data.columns.rejected)")
        raise ValueError(f"dpo: partition {partition!r} yields no preference pairs: {source} for any of its "
                         f"{len(rows)} rows")
    return pairs, skipped


def branch_sample(session: Any, row: Any, answer: str, features: torch.Tensor) -> Sample:
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


class DPOStage(Stage):
    """Pairs fixed at build time, drawn in a seeded order; the loss against the frozen SFT reference."""

    postfix = ("loss", "margin")

    def model_args(self) -> dict[str, Any]:
        return {"train_projector": False}

    def build(self, ctx: StageContext) -> None:
        opts, session = self.opts, ctx.session
        self.task = resolve_task(ctx.recipe, session.registry)
        self.mixture = Mixture(opts.mixture, opts.seed)
        # the pairs are fixed for the run: a generator draws from its own seeded stream, not the data order's
        pairs_rng = random.Random(f"dpo-pairs-{opts.seed}")
        self.pairs_of, self.skipped = {}, 0  # partition -> its pairs
        for partition in self.mixture.names:
            pairs, skipped = preference_pairs(self.task, list(session.data.rows(partition)), pairs_rng, partition)
            self.pairs_of[partition] = pairs
            self.skipped += skipped
        self.pairs = [pair for pairs in self.pairs_of.values() for pair in pairs]
        self.reference = {n: p.detach().clone() for n, p in ctx.model.named_parameters() if p.requires_grad}
        self.probe = self.pairs[: opts.probe_pairs]
        self.rng = random.Random(opts.seed)
        self.probe_start: dict[str, float] | None = None

    def _probe(self, ctx: StageContext) -> dict[str, float]:
        ctx.model.eval()
        result = pair_metrics(ctx.model, ctx.session, self.probe, self.reference, self.opts.beta)
        ctx.model.train()
        return result

    def start(self, ctx: StageContext) -> None:
        if self.probe_start is None:  # at step 0 the policy equals the reference (loss = log 2, margin 0)
            self.probe_start = self._probe(ctx)

    def step(self, ctx: StageContext) -> dict[str, Any]:
        opts, model = self.opts, ctx.model
        drawn = [self.mixture.pick(self.pairs_of, self.rng) for _ in range(opts.pairs_per_step)]
        micro = opts.micro_batch_size or len(drawn)
        pols, logits_all = [], []
        for start in range(0, len(drawn), micro):  # gradient accumulation: each chunk adds its share of the mean
            part = drawn[start:start + micro]
            # each branch carries its own copy of the features; its placeholders are checked against them
            batch = pair_batch(ctx.session, part)
            with torch.no_grad():
                ref = sequence_logprob(model, batch, params=self.reference)
            pol = sequence_logprob(model, batch)
            n = len(part)
            logits = opts.beta * ((pol[:n] - ref[:n]) - (pol[n:] - ref[n:]))
            (-F.logsigmoid(logits).sum() / len(drawn)).backward()
            pols.append(pol.detach().view(2, n))
            logits_all.append(logits.detach())
        ctx.update()
        logits = torch.cat(logits_all)
        chosen, rejected = torch.cat([p[0] for p in pols]), torch.cat([p[1] for p in pols])
        return {"loss": float(-F.logsigmoid(logits).mean()), "margin": float(logits.mean() / opts.beta),
                "chosen_logprob": float(chosen.mean()), "rejected_logprob": float(rejected.mean()),
                "accuracy": float((logits > 0).float().mean())}

    def state_dict(self) -> dict[str, Any]:
        return {"rng": random_to_json(self.rng), "probe_start": self.probe_start,
                "mixture": self.mixture.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random_from_json(self.rng, state["rng"])
        if "mixture" in state:
            self.mixture.load_state_dict(state["mixture"])
        self.probe_start = state["probe_start"]

    def summary(self, ctx: StageContext, history: list[dict[str, Any]]) -> dict[str, Any]:
        end = self._probe(ctx)
        return {
            "task": self.task.name, "pairs": len(self.pairs), "rows_skipped": self.skipped,
            "probe_pairs": len(self.probe),
            "probe_loss_start": self.probe_start["loss"], "probe_loss_end": end["loss"],
            "probe_margin_start": self.probe_start["margin"], "probe_margin_end": end["margin"],
            "margin_first": history[0]["margin"] if history else None,
            "margin_last": history[-1]["margin"] if history else None,
            "data": self.mixture.report(),
        }
