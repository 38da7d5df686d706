"""GRPO step breakdown on a 4B architecture with the embedded rollout engine: seconds per part (rollout,
log-probs, train, refit) and rollout tokens/s, stitch against an encoder-in-the-loop baseline measured in
the same run (issue 7, part 3).

One step runs ``stitch.stages.grpo.GRPOStage.step``'s parts through the same functions: prompt embeddings from
``StitchedModel.embed`` -> ``EmbeddedEngine.generate`` (``--prompts`` x ``--group`` sampled completions,
sentinel ids suppressed) -> ``group_advantages`` -> ``micro_batches`` -> ``score_rollouts`` (old and reference
log-probs, the reference through ``params=`` substitution of frozen copies of the trainable parameters and the
projector anchor) and ``engine_parity`` -> ``policy_gradients`` (clipped surrogate + k3 KL) + grad clipping + AdamW (
``GRPOOptions`` defaults: adapter lr 1e-4, clip 0.2, beta 0.04, one update per batch, adapter only, one
micro-batch) -> ``engine.refit(None)`` (a no-op for the embedded engine; timed anyway). The LM, LoRA (r=16,
alpha 32 on the ModelSpec's targets) and ``mlp2x_gelu`` projector come from ``sft_throughput.build_stitched``;
weights are random-init, so there is no verifiable reward: rewards are random 0/1 from a seeded generator, the
same draws in both modes.

Prompts: 49 image placeholders between the start/end sentinels + 40 random text tokens
(``sft_throughput.make_samples``); cached features [1, 49, 768] bf16 on the CPU, as the cache returns them.
One prompt length, and completions that almost always run to ``--max-new-tokens``, keep every step's shapes
those the warm-up steps already met (on the GPU the first use of a new length costs up to ~2 s, see part 2).

Modes (same model, same prompts, sampling seed, rewards and starting adapter; the adapter and AdamW state
are reset between modes):

* ``stitch``    features from the cache, as ``GRPOStage.step`` runs: ``EmbeddedEngine``'s fixed-cache decoder with
                CUDA-graph decode steps (``stitch.rollout.decode``), the shipped default for full-attention models.
* ``generate``  the same as ``stitch`` but the engine runs transformers ``generate`` (``static_decode=False``): stock
                transformers decoding, what the embedded engine shipped before, measured in the same process.
* ``full_logits`` the same as ``stitch`` but the log-probs (old, reference and the training forward's) come from the
                full [rows, length, vocab] logits in fp32 (``full_logits_token_logprobs``), as ``token_logprobs``
                computed them before ``StitchedModel.token_logprobs`` ran the head on labelled positions in chunks.
* ``baseline``  encoder in the loop (TRL / EasyR1 style): the frozen bf16 CLIP ViT-B/32 tower (sdpa, real
                config, random init) runs on raw pixels for every forward that needs the image: once on the
                prompts before the rollout, then on the batch's rows inside the old-log-prob, reference and
                each training forward. Pixels sit on the GPU already (no host copy is charged).

Every part is bracketed by ``torch.cuda.synchronize``; the baseline's CLIP calls are bracketed too and
reported as ``clip_s`` inside their part. ``reward_collate`` (random rewards, advantages, collation, copy
to the device) is timed as its own part. Completion tokens count up to and including EOS, as grpo.py's
mask does; random-init weights rarely sample EOS, so most completions run to ``--max-new-tokens``.

Command (on the H200 machine, repo root):

    PYTHONPATH=. python3 benchmarks/grpo_breakdown.py --shape dense4b --out benchmarks/results
    PYTHONPATH=. python3 benchmarks/grpo_breakdown.py --modes stitch,generate --micro-batch-size 16 --tag _graph
    # CPU check in seconds: PYTHONPATH=. python benchmarks/grpo_breakdown.py --smoke --out /tmp/bench
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import log, now, peak_gib, reset_peak, write_result  # noqa: E402
from benchmarks.sft_throughput import (  # noqa: E402
    FEATURE_WIDTH,
    IMAGE_TOKENS,
    build_stitched,
    clip_features,
    clip_tower,
    kernel_report,
    make_samples,
    plugin_host,
)

PAD_ID = 0
PARTS = ("rollout", "reward_collate", "logprobs", "train", "refit")
CLIP_PARTS = ("rollout", "logprobs", "train")


def build_policy(args, host, device):
    """The stitched 4B model as GRPO trains it: adapter trainable, projector frozen; ids incl. EOS."""
    model, _, _, ids, info = build_stitched(args.shape, args, host, device)
    model.projector.requires_grad_(False)  # GRPOOptions.train_projector defaults to False
    ids["eos"] = info["vocab_size"] - 4  # an ordinary vocabulary id, not a sentinel
    return model, ids, info


def run_mode(
    mode: str, model, reference, anchor, prompts, pixels, opts, args, ids, device, clip=None
) -> dict:
    from stitch.data.packing import Sample
    from stitch.rollout.engines import EmbeddedEngine
    from stitch.stages.grpo import (
        engine_parity,
        group_advantages,
        micro_batches,
        policy_gradients,
        score_rollouts,
    )
    from stitch.stages.loop import audit_gradients

    with torch.no_grad():  # every mode starts from the same adapter (the warm start = the KL reference)
        for n, p in model.named_parameters():
            if n in reference:
                p.copy_(reference[n])
    allowed = ("adapter",)
    audit_gradients(model, allowed)
    groups = [
        {
            "params": [p for n, p in model.named_parameters() if p.requires_grad and "lora_" in n],
            "lr": opts.lr_adapter,
            "name": "adapter",
        }
    ]
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    sentinels = [ids["start"], ids["placeholder"], ids["end"]]
    engine = EmbeddedEngine(model.lm, pad_id=PAD_ID, eos_id=ids["eos"], suppress_ids=sentinels,
                            static_decode=mode != "generate")
    log(f"{mode}: rollout engine {engine.decode_path}")
    ref_params = {**reference, **{f"projector.{n}": t for n, t in anchor.items()}}
    rng = random.Random(args.seed)
    reward_gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    pix = pixels.to(device, torch.bfloat16) if clip is not None else None
    no_features = torch.empty(0, IMAGE_TOKENS, FEATURE_WIDTH, dtype=torch.bfloat16)
    part = {"name": "rollout"}
    clip_s = {}
    last = {}  # the latest step's micro-batches, for --profile-logprobs

    def encode(row_ids):
        """Baseline only: the frozen tower on these rows' raw pixels, charged to the running part's clip_s."""
        t = now()
        idx = torch.tensor([int(r[1:]) % pix.shape[0] for r in row_ids], device=device)
        feats = clip_features(clip, pix[idx], args.smoke)
        clip_s[part["name"]] += now() - t
        return feats

    def fed(batch):
        return batch if clip is None else dataclasses.replace(batch, features=encode(batch.row_ids))

    def one_step() -> dict:
        secs, peaks = {}, {}
        clip_s.clear()
        clip_s.update(dict.fromkeys(CLIP_PARTS, 0.0))
        clock = [now()]

        def lap(name):  # close part `name`: synchronised seconds and its peak memory
            t = now()
            secs[name], clock[0] = t - clock[0], t
            peaks[name] = peak_gib()
            torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None

        drawn = [prompts[rng.randrange(len(prompts))] for _ in range(opts.prompts_per_step)]
        part["name"] = "rollout"
        model.eval()
        with torch.no_grad():
            feats = encode([s.row_id for s in drawn]) if clip is not None else None
            embeds = []
            for i, s in enumerate(drawn):
                f = s.features if feats is None else feats[i : i + 1]
                embeds.append(
                    model.embed(torch.tensor([s.input_ids], device=device), f.to(device), [s.row_id])[0]
                )
            completions = engine.generate(embeds, opts.group_size, opts.max_new_tokens, opts.temperature)
        lap("rollout")
        rewards = torch.randint(0, 2, (len(completions),), generator=reward_gen).float()
        adv = group_advantages(rewards, opts.group_size).to(device)
        samples = []
        for c in completions:
            s = drawn[c.prompt_index]
            f = s.features if clip is None else no_features
            samples.append(
                [Sample(s.row_id, s.input_ids + c.token_ids, [-100] * len(s.input_ids) + c.token_ids, f)]
            )
        chunks, batches = micro_batches(samples, PAD_ID, opts.micro_batch_size, device)
        last.update(chunks=chunks, batches=batches, adv=adv)
        lap("reward_collate")
        part["name"] = "logprobs"
        old_lp, ref_lp, mask = score_rollouts(model, batches, opts.temperature, ref_params, sentinels, prepare=fed)
        parity = engine_parity(completions, old_lp, mask)
        lap("logprobs")
        part["name"] = "train"
        for _ in range(opts.updates_per_batch):
            loss, kl = policy_gradients(model, chunks, batches, old_lp, ref_lp, adv, mask, opts, sentinels,
                                        prepare=fed)
            # what the stage loop's update does: audit, clip to grad_clip, step
            audit_gradients(model, allowed)
            torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], opts.grad_clip or float("inf"))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        lap("train")
        engine.refit(None)
        lap("refit")
        lengths = [len(c.token_ids) for c in completions]
        return {
            "s": secs,
            "clip_s": dict(clip_s),
            "peak_gib": peaks,
            "gen_tokens": int(mask.sum()),
            "max_len": max(lengths),
            "eos_ended": sum(c.token_ids[-1] == ids["eos"] for c in completions if c.token_ids),
            "sequences": len(completions),
            "batch_width": int(batches[0].input_ids.shape[1]),
            "loss": float(loss),
            "kl": float((kl * mask).sum() / mask.sum().clamp(min=1)),
            "parity": parity,
        }

    reset_peak()
    warm, timed = [], []
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        rec = one_step()
        rec["step_s"] = time.perf_counter() - t0
        (warm if step < args.warmup else timed).append(rec)
        log(
            f"{mode} step {step}{' (warm-up)' if step < args.warmup else ''}: {rec['step_s']:.3f} s "
            + " ".join(f"{k} {v:.3f}" for k, v in rec["s"].items())
            + f", {rec['gen_tokens']} tokens"
        )
    result = summarize_mode(mode, warm, timed, clip is not None)
    if args.profile_rollout and mode in args.profile_modes.split(","):
        from benchmarks.sft_throughput import profile_steps

        drawn = prompts[: opts.prompts_per_step]
        with torch.no_grad():
            embeds = [model.embed(torch.tensor([s.input_ids], device=device), s.features.to(device), [s.row_id])[0]
                      for s in drawn]
        result["rollout_profile"] = profile_steps(
            lambda: engine.generate(embeds, opts.group_size, opts.max_new_tokens, opts.temperature),
            args.profile_rollout, top=40)
        result["rollout_profile"]["decode_steps"] = opts.max_new_tokens
    if args.profile_logprobs and mode in args.profile_modes.split(","):
        result["logprobs_profile"], result["train_profile"] = profile_scoring(
            model, last, ref_params, opts, sentinels, fed, args.profile_logprobs)
    result["decode_path"] = engine.decode_path
    steps = getattr(engine.decoder, "_steps", {})
    result["decode_graphs"] = sum(s.graph is not None for s in steps.values())
    return result


def full_logits_token_logprobs(model, batch, temperature: float = 1.0, params=None, suppress_ids=()):
    """``stitch.stages.logprobs.token_logprobs`` as it was before the chunked head (the ``full_logits`` mode)."""
    from stitch.rollout.engines import mask_suppressed
    from stitch.stages.logprobs import logits_with

    logits = model.logits(batch) if params is None else logits_with(model, params, batch)
    logits = mask_suppressed(logits[:, :-1].float(), suppress_ids) / temperature
    target = batch.labels[:, 1:]
    lp = torch.log_softmax(logits, dim=-1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return lp, target != -100


def profile_scoring(model, last: dict, ref_params: dict, opts, sentinels: list, fed, steps: int) -> tuple[dict, dict]:
    """The last step's log-prob pass (policy + reference, no grad) and its policy-gradient pass (forward + backward,
    gradients dropped after), each timed wall-clock over ``steps`` synchronised calls and then profiled."""
    from benchmarks.sft_throughput import profile_steps, sync
    from stitch.stages.grpo import policy_gradients, score_rollouts

    batches, chunks = last["batches"], last["chunks"]
    model.eval()
    with torch.no_grad():
        old_lp, ref_lp, mask = score_rollouts(model, batches, opts.temperature, ref_params, sentinels, prepare=fed)

    def scoring():
        model.eval()
        with torch.no_grad():
            score_rollouts(model, batches, opts.temperature, ref_params, sentinels, prepare=fed)

    def gradients():
        policy_gradients(model, chunks, batches, old_lp, ref_lp, last["adv"], mask, opts, sentinels, prepare=fed)
        model.zero_grad(set_to_none=True)

    out = []
    for fn in (scoring, gradients):
        sync()
        t = now()
        for _ in range(steps):
            fn()
        sync()
        wall = (now() - t) / steps
        prof = profile_steps(fn, steps, top=30)
        prof["wall_ms_per_call"] = round(wall * 1000, 2)
        out.append(prof)
    return out[0], out[1]


def decode_parity(model, prompts, ids, device, rows: int = 8, tokens: int = 64) -> dict:
    """Greedy completions of ``rows`` prompts from the fixed-cache (graph) decoder against transformers
    ``generate`` on the same weights: identical rows, the first step where a row differs, log-prob gaps."""
    from stitch.rollout.engines import EmbeddedEngine

    sentinels = [ids["start"], ids["placeholder"], ids["end"]]
    model.eval()
    with torch.no_grad():
        embeds = [model.embed(torch.tensor([s.input_ids], device=device), s.features.to(device), [s.row_id])[0]
                  for s in prompts[:rows]]
        out = {}
        for name, static in (("fixed_cache", True), ("generate", False)):
            engine = EmbeddedEngine(model.lm, pad_id=PAD_ID, eos_id=ids["eos"], suppress_ids=sentinels,
                                    static_decode=static)
            out[name] = engine.generate(embeds, 1, tokens, greedy=True)
    first_diff = []
    gaps = []
    for a, b in zip(out["fixed_cache"], out["generate"], strict=True):
        diff = next((t for t, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y), None)
        first_diff.append(diff)
        upto = len(a.token_ids) if diff is None else diff + 1  # log-probs compared while the prefixes agree
        gaps.append(max(abs(x - y) for x, y in zip(a.logprobs[:upto], b.logprobs[:upto], strict=False)))
    return {
        "rows": rows,
        "tokens": tokens,
        "identical_rows": sum(d is None for d in first_diff),
        "first_differing_step": first_diff,
        "max_abs_logprob_gap_on_shared_prefix": round(max(gaps), 5),
    }


def summarize_mode(mode: str, warm: list, timed: list, with_clip: bool) -> dict:
    med = statistics.median
    parts_s = {p: [round(r["s"][p], 4) for r in timed] for p in PARTS}
    step_s = [r["step_s"] for r in timed]
    gen = [r["gen_tokens"] for r in timed]
    seqs = sum(r["sequences"] for r in timed)
    rollout_total = sum(parts_s["rollout"])
    result = {
        "mode": mode,
        "steps": len(timed),
        "step_s_median": round(med(step_s), 4),
        "step_s_mean": round(sum(step_s) / len(step_s), 4),
        "parts_s_median": {p: round(med(v), 4) for p, v in parts_s.items()},
        "parts_share": {p: round(sum(v) / sum(step_s), 4) for p, v in parts_s.items()},
        "rollout_tokens_per_s": round(sum(gen) / rollout_total, 1),
        "rollout_tokens_per_s_median": round(
            med(g / r for g, r in zip(gen, parts_s["rollout"], strict=True)), 1
        ),
        "generated_tokens_per_step": gen,
        "mean_completion_tokens": round(sum(gen) / seqs, 2),
        "max_completion_tokens": max(r["max_len"] for r in timed),
        "eos_ended_share": round(sum(r["eos_ended"] for r in timed) / seqs, 4),
        "sequences_per_step": timed[0]["sequences"],
        "train_batch_width": [r["batch_width"] for r in timed],
        "peak_gib": max(
            (v for r in warm + timed for v in r["peak_gib"].values() if v is not None), default=None
        ),
        "peak_gib_by_part": {p: max((r["peak_gib"][p] or 0) for r in warm + timed) for p in PARTS}
        if timed[0]["peak_gib"]["rollout"] is not None
        else None,
        "parity_max_abs_logprob": max(r["parity"] for r in timed),
        "last_loss": round(timed[-1]["loss"], 5),
        "last_kl": round(timed[-1]["kl"], 6),
        "warmup_step_s": [round(r["step_s"], 3) for r in warm],
        "step_s": [round(t, 4) for t in step_s],
        "parts_s": parts_s,
    }
    if with_clip:
        clip = {p: [round(r["clip_s"][p], 4) for r in timed] for p in CLIP_PARTS}
        result["clip_s_median"] = {p: round(med(v), 4) for p, v in clip.items()}
        result["clip_s_per_step_median"] = round(med(sum(r["clip_s"].values()) for r in timed), 4)
        result["clip_share"] = round(sum(sum(v) for v in clip.values()) / sum(step_s), 4)
        result["clip_s"] = clip
    return result


def summarize(info: dict, opts, modes: dict, args) -> dict:
    seqs = opts.prompts_per_step * opts.group_size
    out = {
        "model": info,
        "grpo_options": opts.model_dump(),
        "rewards": "random 0/1 from a seeded torch.Generator (random-init weights: no verifiable reward); "
        "the same draws in both modes",
        "engine": "stitch.rollout.engines.EmbeddedEngine on the live policy: fixed-cache + CUDA-graph decode "
        "(stitch, baseline) or transformers generate (generate)",
        "timing": "torch.cuda.synchronize at every part boundary and around each baseline CLIP call; "
        "median over the timed steps after --warmup steps",
        "estimates": {
            # EmbeddedEngine keeps generate's per-step fp32 logits, stacks them, masks a copy, scales, log_softmaxes
            "engine_logits_fp32_gib_per_copy": round(
                seqs * opts.max_new_tokens * info["vocab_size"] * 4 / 2**30, 2
            ),
            "engine_logits_copies_alive_at_peak": 4,
        },
        "modes": dict(modes),
    }
    stitch, base, stock = modes.get("stitch", {}), modes.get("baseline", {}), modes.get("generate", {})
    if stitch.get("rollout_tokens_per_s") and stock.get("rollout_tokens_per_s"):
        out["ratio_stitch_over_generate_rollout_tokens_per_s"] = round(
            stitch["rollout_tokens_per_s"] / stock["rollout_tokens_per_s"], 3)
        out["ratio_generate_over_stitch_step_s"] = round(stock["step_s_median"] / stitch["step_s_median"], 3)
    full = modes.get("full_logits", {})
    if stitch.get("step_s_median") and full.get("step_s_median"):
        out["ratio_full_logits_over_stitch"] = {
            "step_s": round(full["step_s_median"] / stitch["step_s_median"], 4),
            **{p: round(full["parts_s_median"][p] / stitch["parts_s_median"][p], 4) for p in ("logprobs", "train")},
            "peak_gib": round(full["peak_gib"] / stitch["peak_gib"], 4) if stitch.get("peak_gib") else None,
        }
    if stitch.get("step_s_median") and base.get("step_s_median"):
        out["ratio_baseline_over_stitch_step_s"] = round(base["step_s_median"] / stitch["step_s_median"], 4)
        out["ratio_by_part"] = {
            p: round(base["parts_s_median"][p] / stitch["parts_s_median"][p], 4)
            for p in PARTS
            if stitch["parts_s_median"][p] > 0
        }
    return out


def print_table(out: dict) -> None:
    cols = ("step s", *PARTS, "clip s", "gen tok/step", "rollout tok/s", "peak GiB", "x stitch", "rollout share")
    log(" | ".join(("mode", *cols)))
    ratio = out.get("ratio_baseline_over_stitch_step_s")
    for mode, r in out["modes"].items():
        if "error" in r:
            log(f"{mode} | {r['error'][:100]}")
            continue
        row = [
            mode,
            f"{r['step_s_median']:.3f}",
            *(f"{r['parts_s_median'][p]:.4f}" for p in PARTS),
            f"{r.get('clip_s_per_step_median', 0.0):.4f}",
            f"{statistics.median(r['generated_tokens_per_step']):.0f}",
            f"{r['rollout_tokens_per_s']:.1f}",
            str(r["peak_gib"]),
            f"{ratio:.3f}" if mode == "baseline" and ratio else "1.000" if mode == "stitch" else "-",
            f"{r['parts_share']['rollout']:.3f}",
        ]
        log(" | ".join(row))
    log(
        "mean completion tokens: "
        + ", ".join(f"{m} {r.get('mean_completion_tokens')}" for m, r in out["modes"].items())
    )
    if "ratio_full_logits_over_stitch" in out:
        log(f"full_logits / stitch: {out['ratio_full_logits_over_stitch']}")
    if "ratio_stitch_over_generate_rollout_tokens_per_s" in out:
        log(f"rollout tok/s stitch / generate = {out['ratio_stitch_over_generate_rollout_tokens_per_s']}, "
            f"step s generate / stitch = {out['ratio_generate_over_stitch_step_s']}")


def main() -> None:
    from stitch.config.options import GRPOOptions

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="dense4b", choices=("dense4b", "qwen35_4b", "nemotron4b"))
    ap.add_argument("--modes", default="stitch,baseline")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--prompt-pool", type=int, default=256, help="distinct prompts drawn from")
    ap.add_argument("--pixel-pool", type=int, default=64, help="distinct raw pixel tensors (cycled)")
    ap.add_argument("--text-min", type=int, default=40, help="prompt text tokens (uniform in min..max)")
    ap.add_argument("--text-max", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile-rollout", type=int, default=0, help="profile N extra rollouts of --profile-modes")
    ap.add_argument("--profile-logprobs", type=int, default=0,
                    help="time and profile N more log-prob and policy-gradient passes of --profile-modes")
    ap.add_argument("--profile-modes", default="stitch")
    ap.add_argument("--skip-parity", action="store_true", help="skip the greedy fixed-cache vs generate check")
    ap.add_argument("--micro-batch-size", type=int, default=None, help="GRPOOptions.micro_batch_size")
    ap.add_argument("--grad-ckpt", action="store_true")
    ap.add_argument(
        "--attn", default="sdpa", help="attn_implementation for the LM: sdpa | eager | flex_attention"
    )
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--tag", default="", help="suffix for the result name grpo_<shape><tag>")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.prompts, args.group, args.max_new_tokens = 2, 1, 2, 4, 8
        args.prompt_pool, args.pixel_pool = 16, 4
    opts = GRPOOptions(
        prompts_per_step=args.prompts,
        group_size=args.group,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        micro_batch_size=args.micro_batch_size,
    )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kernels = kernel_report()
    log(f"device {device}; kernels {kernels}")
    host = plugin_host()
    t0 = time.perf_counter()
    model, ids, info = build_policy(args, host, device)
    info["build_s"] = round(time.perf_counter() - t0, 1)
    log(json.dumps(info))
    # the warm start: frozen copies substituted for the reference forward, as GRPOStage.build keeps them
    reference = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    anchor = {n: p.detach().clone() for n, p in model.projector.named_parameters()}
    prompts, pixels = make_samples(
        args.prompt_pool,
        info["vocab_size"],
        ids,
        args.text_min,
        args.text_max,
        args.seed,
        args.pixel_pool,
        args.smoke,
    )
    name = f"grpo_{args.shape}{args.tag}"
    modes: dict = {}
    if not args.skip_parity:
        info["greedy_decode_parity"] = decode_parity(model, prompts, ids, device, tokens=8 if args.smoke else 64)
        log(f"greedy parity fixed-cache vs generate: {json.dumps(info['greedy_decode_parity'])}")

    def save() -> dict:  # after every mode: a run cut short by a time limit still leaves what it finished
        out = summarize(info, opts, modes, args)
        write_result(name, {"config": vars(args), "kernels": kernels, **out}, args.out)
        return out

    import stitch.stages.grpo as grpo_stage

    shipped = grpo_stage.token_logprobs  # the full_logits mode swaps it for its own run only
    for mode in args.modes.split(","):
        clip = clip_tower(device, args.smoke) if mode == "baseline" else None
        if mode == "full_logits":
            grpo_stage.token_logprobs = full_logits_token_logprobs
        try:
            modes[mode] = run_mode(
                mode, model, reference, anchor, prompts, pixels, opts, args, ids, device, clip
            )
        except torch.OutOfMemoryError as exc:
            modes[mode] = {"mode": mode, "error": f"OOM: {str(exc)[:300]}"}
        finally:
            grpo_stage.token_logprobs = shipped
        clip = None
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        log(
            f"{args.shape} {mode}: {json.dumps({k: v for k, v in modes[mode].items() if k not in ('parts_s', 'clip_s')})}"
        )
        out = save()
    print_table(out)


if __name__ == "__main__":
    main()
