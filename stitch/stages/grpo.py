"""GRPO step: group sampling from a rollout engine on prompt embeddings built through the registered rollout
payload, the recipe task's reward, group-normalised advantages, clipped policy loss and a KL leash to the SFT
reference (the warm start the stage table names, behind the provenance gate).

Only the adapter trains by default; ``train_projector: true`` adds the projector as its own parameter group
(constant LR only), logs its relative-L2 drift before every update, and anchors the KL reference to the
warm-start projector.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

import torch

from stitch.config.recipe import Recipe, RecipeError
from stitch.data.mixture import Mixture
from stitch.data.packing import Sample, collate_packs
from stitch.rollout.engines import sampling_seed
from stitch.rollout.prompts import payload_for, prompt_embeddings
from stitch.rollout.ray_rollout import RayRolloutEngine
from stitch.runs.checkpoint import random_from_json, random_to_json
from stitch.stages.logprobs import token_logprobs
from stitch.stages.loop import Stage, StageContext
from stitch.stages.rollout_log import (
    CompletionLog,
    CompletionRecord,
    SignalWatch,
    flat_groups,
    hit_length_cap,
)
from stitch.tasks import resolve_task


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    groups = rewards.view(-1, group_size)
    adv = (groups - groups.mean(dim=1, keepdim=True)) / (groups.std(dim=1, keepdim=True) + eps)
    return adv.view(-1)


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


WIDTH_MULTIPLE = 64  # padded widths of a step round up to this: a few shapes across steps, not one per step


def micro_batches(samples: list[list[Sample]], pad_id: int, size: int | None,
                  device: torch.device | str) -> tuple[list[range], list[Any]]:
    """The step's sequences as padded batches of at most ``size`` rows (None: one batch), all one width: the
    longest sequence rounded up to ``WIDTH_MULTIPLE``, so that kernels tuned or captured for a shape (Triton
    autotuning, CUDA graphs of the LoRA blocks) see it again on later steps instead of a new width every step."""
    longest = max(len(pack[0]) for pack in samples)
    width = -(-longest // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
    size = size or len(samples)
    chunks = [range(i, min(i + size, len(samples))) for i in range(0, len(samples), size)]
    batches = [collate_packs([samples[i] for i in chunk], pad_id, packed=False, length=width).to(device)
               for chunk in chunks]
    return chunks, batches


@torch.no_grad()
def score_rollouts(model: Any, batches: list[Any], temperature: float, reference_params: dict[str, torch.Tensor],
                   suppress_ids: Sequence[int]):
    """(old log-probs, reference log-probs, completion mask) over all micro-batches."""
    old = [token_logprobs(model, b, temperature, suppress_ids=suppress_ids) for b in batches]
    ref = [token_logprobs(model, b, temperature, params=reference_params, suppress_ids=suppress_ids)[0]
           for b in batches]
    return torch.cat([lp for lp, _ in old]), torch.cat(ref), torch.cat([m for _, m in old])


def engine_parity(completions: Sequence[Any], old_lp: torch.Tensor, mask: torch.Tensor) -> float:
    """Largest gap between the engine's log-prob of a sampled token and the training forward's."""
    engine_lp = torch.zeros_like(old_lp)
    for i, c in enumerate(completions):
        pos = mask[i].nonzero().squeeze(-1)
        engine_lp[i, pos] = torch.tensor(c.logprobs, device=old_lp.device, dtype=engine_lp.dtype)
    return float((engine_lp - old_lp)[mask].abs().max()) if mask.any() else 0.0


def policy_gradients(model: Any, chunks: list[range], batches: list[Any], old_lp: torch.Tensor, ref_lp: torch.Tensor,
                     adv: torch.Tensor, mask: torch.Tensor, opts: Any,
                     suppress_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of the GRPO loss over all micro-batches, gradients accumulated into one update (the caller
    applies it); returns (loss, per-token kl)."""
    model.train()
    total = chunks[-1].stop
    loss, kls = torch.zeros((), device=old_lp.device), []
    for chunk, b in zip(chunks, batches, strict=True):
        part = slice(chunk.start, chunk.stop)
        lp, _ = token_logprobs(model, b, opts.temperature, suppress_ids=suppress_ids)
        chunk_loss, chunk_kl = grpo_loss(lp, old_lp[part], ref_lp[part], adv[part], mask[part], opts.clip_eps,
                                         opts.kl_beta)
        # the step's loss is a mean over sequences: weight each chunk by its share of them
        weighted = chunk_loss * (len(chunk) / total)
        weighted.backward()
        loss, kls = loss + weighted.detach(), kls + [chunk_kl.detach()]
    return loss, torch.cat(kls)


def projector_drift(projector: torch.nn.Module, anchor: dict[str, torch.Tensor]) -> float:
    num = sum(float((p.detach() - anchor[n]).pow(2).sum()) for n, p in projector.named_parameters())
    den = sum(float(anchor[n].pow(2).sum()) for n, _ in projector.named_parameters())
    return (num / max(den, 1e-30)) ** 0.5


class GRPOStage(Stage):
    """Rollouts of the live policy, the task's reward, one clipped-surrogate + KL update per ``updates_per_batch``."""

    postfix = ("reward", "kl")

    def check(self, recipe: Recipe) -> None:
        opts = self.opts
        if opts.train_projector and (opts.schedule != "constant" or opts.warmup_steps):
            raise RecipeError(
                f"recipe {recipe.name!r}: field 'stages.grpo.schedule': the trainable-projector variant needs a "
                f"constant LR schedule without warmup (a warm start's projector group must not be rescaled), got "
                f"{opts.schedule!r} with warmup_steps={opts.warmup_steps}"
            )

    def model_args(self) -> dict[str, Any]:
        return {"train_projector": self.opts.train_projector}

    def build(self, ctx: StageContext) -> None:
        opts, session, model = self.opts, ctx.session, ctx.model
        self.task = resolve_task(ctx.recipe, session.registry)
        self.mixture = Mixture(opts.mixture, opts.seed)
        self.rows = {}  # partition -> the rows of it the task can reward
        for partition in self.mixture.names:
            rows = list(session.data.rows(partition))
            self.rows[partition] = [r for r in rows if self.task.takes(r.task_row())]
            if not self.rows[partition]:
                raise ValueError(f"grpo: partition {partition!r} has no rows task {self.task.name!r} can reward "
                                 f"({len(rows)} rows, none accepted)")
        self.payload = payload_for(session.registry, session.encoder_spec)
        self.rng = random.Random(opts.seed)
        # reference = the warm start: SFT adapter and SFT projector, frozen copies substituted at call time
        self.reference = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        self.anchor = {n: p.detach().clone() for n, p in model.projector.named_parameters()}
        self.timings = {"rollout": 0.0, "logprobs": 0.0, "train": 0.0, "refit": 0.0}
        self.eval_accuracy_start: float | None = None
        path = ctx.layout.completions(ctx.name)
        self.completion_log = CompletionLog(path, opts.log_every if ctx.dp.is_main else 0)
        self.watch = SignalWatch(opts.flat_reward_steps, path)

    def start(self, ctx: StageContext) -> None:
        # built after a resume has restored the adapter: engines holding their own weights start from the live policy
        opts, binding, lm = self.opts, ctx.binding, ctx.model.lm
        common = {"pad_id": binding.pad_id, "eos_id": binding.tokenizer.eos_token_id,
                  "suppress_ids": binding.suppress_ids}
        if opts.placement == "ray":
            self.engine = RayRolloutEngine.for_recipe(ctx.recipe, lm, engine=opts.engine,
                                                      model=binding.model_spec.name, registry=binding.registry,
                                                      snapshot=binding.snapshot,
                                                      base_fingerprint=binding.base_fingerprint, seed=opts.seed,
                                                      **common)
            ctx.cleanup.callback(self.engine.close)
        else:
            self.engine = binding.registry.get("rollout_engines", opts.engine).factory(lm, **common)
        if opts.eval_partition and ctx.step == 0:
            self.eval_accuracy_start = ctx.evaluate()
        if ctx.dp.is_main and ctx.step == 0:  # a fresh run starts a fresh file
            self.completion_log.reset()
        elif ctx.dp.is_main:  # a resumed one drops the rows past its checkpoint
            self.completion_log.truncate_after(ctx.step)

    def step(self, ctx: StageContext) -> dict[str, Any]:
        opts, session, model = self.opts, ctx.session, ctx.model
        suppress = ctx.binding.suppress_ids
        drawn = [self.mixture.pick(self.rows, self.rng) for _ in range(opts.prompts_per_step)]
        t0 = time.perf_counter()
        model.eval()
        with torch.no_grad():
            prompts = [(row.id, session.prompt_ids(row.prompt_messages, row.num_items), session.data.features(row))
                       for row in drawn]
            embeds = prompt_embeddings(self.payload, model, prompts)
            # seeded by (run seed, step): the same rollouts after a resume, whichever engine or process samples
            completions = self.engine.generate(embeds, opts.group_size, opts.max_new_tokens, opts.temperature,
                                               seed=sampling_seed(opts.seed, "rollout", ctx.step))
        rollout_s = time.perf_counter() - t0  # the engine hands back token lists: the device work is done
        self.timings["rollout"] += rollout_s
        texts = session.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        rewards = torch.tensor([self.task.reward(text, drawn[c.prompt_index].task_row())
                                for text, c in zip(texts, completions, strict=True)], dtype=torch.float32)
        adv = group_advantages(rewards, opts.group_size).to(session.device)
        capped_share = self.observe_rollouts(ctx, drawn, completions, texts, rewards.tolist(), adv.tolist())
        samples = []
        for c in completions:
            row_id, ids, features = prompts[c.prompt_index]
            samples.append([Sample(row_id, ids + c.token_ids, [-100] * len(ids) + c.token_ids, features)])
        chunks, batches = micro_batches(samples, session.pad_id, opts.micro_batch_size, session.device)
        t1 = time.perf_counter()
        reference_params = {**self.reference, **{f"projector.{n}": t for n, t in self.anchor.items()}}
        old_lp, ref_lp, mask = score_rollouts(model, batches, opts.temperature, reference_params, suppress)
        parity = engine_parity(completions, old_lp, mask)  # reads a value back: the log-prob work is done
        logprob_s = time.perf_counter() - t1
        self.timings["logprobs"] += logprob_s
        drift = projector_drift(model.projector, self.anchor) if opts.train_projector else None
        t2 = time.perf_counter()
        for _ in range(opts.updates_per_batch):
            loss, kl = policy_gradients(model, chunks, batches, old_lp, ref_lp, adv, mask, opts, suppress)
            ctx.update()
        loss_value = float(loss)  # waits for the update's device work, so update_s holds it
        update_s = time.perf_counter() - t2
        self.timings["train"] += update_s
        t3 = time.perf_counter()
        self.engine.refit(None)
        refit_s = time.perf_counter() - t3
        self.timings["refit"] += refit_s
        record = {"reward": float(rewards.mean()), "loss": loss_value,
                  "kl": float((kl * mask).sum() / mask.sum().clamp(min=1)), "parity_max_abs_logprob": parity,
                  "completion_tokens": int(mask.sum()), "capped_share": capped_share,
                  "rollout_tokens": sum(len(c.token_ids) for c in completions),
                  "rollout_steps": max(len(c.token_ids) for c in completions), "rollout_s": rollout_s, "logprob_s": logprob_s, "update_s": update_s, "refit_s": refit_s}
        if drift is not None:
            record["projector_drift"] = drift
        if getattr(self.engine, "refit_bytes", None) is not None:  # engines that count what a refit moved
            record["refit_bytes"] = self.engine.refit_bytes
        return record

    def observe_rollouts(self, ctx: StageContext, drawn: list[Any], completions: Sequence[Any], texts: list[str],
                         rewards: list[float], adv: list[float]) -> float:
        """Feed the no-signal watch, and on a ``log_every`` step write each completion to completions.jsonl;
        returns the share of completions cut by ``max_new_tokens``."""
        opts, step = self.opts, ctx.step + 1
        eos = ctx.session.tokenizer.eos_token_id
        capped = [hit_length_cap(c.token_ids, opts.max_new_tokens, eos) for c in completions]
        share = sum(capped) / len(capped)
        self.watch.observe(step, flat_groups(rewards, opts.group_size), share)
        if self.completion_log.due(step):
            self.completion_log.write([
                CompletionRecord(step, drawn[c.prompt_index].id, c.prompt_index, text, len(c.token_ids),
                                 {self.task.name: r}, a, cap)
                for c, text, r, a, cap in zip(completions, texts, rewards, adv, capped, strict=True)])
        return share

    def state_dict(self) -> dict[str, Any]:
        return {"rng": random_to_json(self.rng), "eval_accuracy_start": self.eval_accuracy_start,
                "signal": self.watch.state_dict(), "mixture": self.mixture.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random_from_json(self.rng, state["rng"])
        if "mixture" in state:
            self.mixture.load_state_dict(state["mixture"])
        self.eval_accuracy_start = state["eval_accuracy_start"]
        self.watch.load_state_dict(state.get("signal", {}))

    def summary(self, ctx: StageContext, history: list[dict[str, Any]]) -> dict[str, Any]:
        k = max(1, len(history) // 4)
        out = {
            "engine": self.opts.engine,
            "decode_path": getattr(self.engine, "decode_path", None),
            "placement": self.opts.placement,
            "task": self.task.name,
            "reward_start": sum(r["reward"] for r in history[:k]) / k if history else None,
            "reward_end": sum(r["reward"] for r in history[-k:]) / k if history else None,
            "seconds_by_part": {part: round(v, 2) for part, v in self.timings.items()},
            "parity_max_abs_logprob": max((r["parity_max_abs_logprob"] for r in history), default=None),
            "flat_reward_steps_max": self.watch.longest,
            "completions": str(self.completion_log.path) if self.completion_log.every else None,
            "completion_table": self.completion_log.last_step_table(),
            "data": self.mixture.report(),
        }
        if self.eval_accuracy_start is not None:
            out["eval_accuracy_start"] = self.eval_accuracy_start
        return out
