"""Alignment and SFT steps: next-token loss on packed rows of the prepared data.

alignment trains only the projector against the frozen LM; sft warm-starts the projector from alignment (the
stage table says so) and trains it jointly with a LoRA adapter on the model plugin's target set, or with the LM's
own weights (``train_lm: full``, all of them or ``train_lm_layers``). Under
``torchrun --nproc-per-node N`` both run FSDP2 data parallel (stitch.stages.distributed): every rank draws the
same global batch and trains on its share; the loss is normalised by the global label count.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from typing import Any

import torch

from stitch.data.packing import PackedStream, collate_packs
from stitch.model.loading import packs_loaded
from stitch.stages.loop import Stage, StageContext

log = logging.getLogger("stitch")
WARMUP_STEPS = 3  # first steps pay for compiling, autotuning and capturing: the steady rate starts after them


class AlignmentStage(Stage):
    """Projector only; the LM is frozen."""

    postfix = ("loss", "pack_fill")

    def build(self, ctx: StageContext) -> None:
        opts, spec = self.opts, ctx.binding.model_spec
        self.packed = opts.packing and packs_loaded(spec, ctx.model)
        if opts.packing and spec.packs() and not self.packed:
            log.warning("%s: packing is available on this machine but the loaded model has no sample-boundary "
                        "path; training unpacked", spec.name)
        make_sample = functools.partial(ctx.session.make_sample, turns=opts.train_turns)
        self.stream = PackedStream(ctx.session.manifest_path, make_sample, token_budget=opts.token_budget,
                                   buffer_size=opts.buffer_size, seed=opts.seed, pack=self.packed,
                                   mixture=opts.mixture)
        self.tokens_seen = 0

    def step(self, ctx: StageContext) -> dict[str, Any]:
        opts = self.opts
        t0 = time.perf_counter()
        packs = [self.stream.next_pack() for _ in range(opts.batch_size)]  # the global batch, on every rank
        micro = opts.micro_batch_size or len(packs)
        if micro >= len(packs):
            loss_value, n_labels, tokens = self._whole_batch(ctx, packs)
        else:
            loss_value, n_labels, tokens = self._accumulated(ctx, packs, micro)
        self.tokens_seen += tokens
        fill = tokens / (len(packs) * opts.token_budget) if self.packed else 1.0
        return {"loss": loss_value, "tokens": tokens, "label_tokens": n_labels, "pack_fill": round(fill, 4),
                "tokens_per_s": round(tokens / (time.perf_counter() - t0), 1)}

    def _collate(self, ctx: StageContext, packs: list[Any]) -> Any:
        return collate_packs(ctx.dp.rows(packs), ctx.session.pad_id, self.packed,
                             length=self.opts.token_budget if self.packed else None).to(ctx.session.device)

    def _whole_batch(self, ctx: StageContext, packs: list[Any]) -> tuple[float, int, int]:
        dp = ctx.dp
        batch = self._collate(ctx, packs)
        loss, n_labels = ctx.model.loss(batch)
        tokens, objective = batch.tokens, loss
        if dp.active:
            # normalise by the global label count (the ranks need the loss before backward for it); the gradient
            # reduce-scatter averages over ranks, hence x world: the averaged gradient is the one-process gradient
            # of the whole batch
            loss_sum, n_global, tokens = dp.all_sum([float(loss.detach()) * n_labels, n_labels, batch.tokens])
            objective = loss * (n_labels * dp.world_size / max(n_global, 1.0))
            loss_value, n_labels, tokens = loss_sum / max(n_global, 1.0), int(n_global), int(tokens)
        objective.backward()
        ctx.update()
        if not dp.active:  # read once the whole step is queued: reading it before backward idles the GPU between
            loss_value = float(loss.detach())
        return loss_value, n_labels, tokens

    def _accumulated(self, ctx: StageContext, packs: list[Any], micro: int) -> tuple[float, int, int]:
        """Gradient accumulation: each micro-batch's backward adds its summed token loss; the sum is then divided
        by the whole step's labelled-token count, so the update equals one batch of all ``packs``."""
        dp = ctx.dp
        loss_sum, n_labels, tokens = 0.0, 0, 0
        sums = []
        for start in range(0, len(packs), micro):
            batch = self._collate(ctx, packs[start:start + micro])
            loss, n = ctx.model.loss(batch)
            (loss * n).backward()
            sums.append(loss.detach() * n)
            n_labels, tokens = n_labels + n, tokens + batch.tokens
        loss_sum = float(torch.stack(sums).sum())
        world = 1
        if dp.active:  # every rank's gradients are averaged by the reduce-scatter: undo that, then divide by all
            loss_sum, n_labels, tokens = dp.all_sum([loss_sum, n_labels, tokens])
            n_labels, tokens, world = int(n_labels), int(tokens), dp.world_size
        ctx.scale_gradients(world / max(n_labels, 1))
        ctx.update()
        return loss_sum / max(n_labels, 1), n_labels, tokens

    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)

    def summary(self, ctx: StageContext, history: list[dict[str, Any]]) -> dict[str, Any]:
        elapsed = time.perf_counter() - ctx.t_start
        fills = [r["pack_fill"] for r in history if "pack_fill" in r]
        return {"tokens_per_s": round(self.tokens_seen / elapsed, 1) if elapsed > 0 else None,
                "steady_tokens_per_s": steady_rate(history),
                "packed": self.packed,
                "mean_pack_fill": round(sum(fills) / len(fills), 4) if fills else None,
                "data": self.stream.mixture.report() if self.stream.mixture else None}


def steady_rate(history: list[dict[str, Any]], warmup: int = WARMUP_STEPS) -> float | None:
    """The median of the per-step ``tokens_per_s`` after the first ``warmup`` steps (all of them when the stage
    ran fewer): the rate a longer run settles at, beside the stage's whole-run average."""
    rates = [r["tokens_per_s"] for r in history if "tokens_per_s" in r]
    rates = rates[warmup:] or rates
    return round(statistics.median(rates), 1) if rates else None


class SFTStage(AlignmentStage):
    """Projector (warm-started from alignment) + a new LoRA adapter, or the LM's own weights (train_lm: full)."""

    def model_args(self) -> dict[str, Any]:
        opts = self.opts
        if opts.train_lm == "full":
            return {"full_lm": True, "lm_layers": opts.train_lm_layers, "train_projector": opts.train_projector,
                    "lm_layers_field": "stages.sft.train_lm_layers"}
        return {"lora": opts.lora, "train_projector": opts.train_projector}
