"""GRPO step seconds split into rollout / log-probs / update, and rollout tokens/s against stock `generate`.

stitch: `stitch prepare`, one alignment and one SFT step (GRPO warm-starts from SFT), then `stitch train grpo`;
the split is the stage's own per-step metrics (rollout_s, logprob_s, update_s, refit_s, rollout_tokens).
stock: transformers' `generate` from the same base, sampling the same number of prompts x group with prompt
embeddings of the same length, in the same process. Medians over the timed steps after warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from benchmarks.common import log, peak_gib, reset_peak, sync
from benchmarks.suites import harness
from benchmarks.suites.sft import IMAGE_TOKENS, stock_lm


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default 8; tiny 2)")
    p.add_argument("--group", type=int, default=None, help="samples per prompt (default 8; tiny 2)")
    p.add_argument("--new-tokens", type=int, default=None, help="max new tokens (default 128; tiny 16)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per forward (default 16; tiny 4)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    shape = harness.SHAPES[args.shape]
    tiny = args.shape == "tiny"
    prompts, group = args.prompts or (2 if tiny else 8), args.group or (2 if tiny else 8)
    new_tokens, micro = args.new_tokens or (16 if tiny else 128), args.micro_batch or (4 if tiny else 16)
    n = 64 if tiny else 256
    host = harness.install_host()
    rows = harness.write_jpeg_rows(args.work / "data", n, unique=min(n, 64))
    lora = {"r": 16, "alpha": 32, "dropout": 0.0}
    budget = 512
    stages = {"alignment": {"partition": "alignment", "steps": 1, "batch_size": 1, "token_budget": budget},
              "sft": {"partition": "train", "steps": 1, "batch_size": 1, "token_budget": budget, "lora": lora},
              "grpo": {"partition": "grpo", "steps": args.warmup + args.steps, "prompts_per_step": prompts,
                       "group_size": group, "max_new_tokens": new_tokens, "micro_batch_size": micro,
                       "temperature": 1.0, "lora": lora}}
    recipe = harness.write_recipe(args.work, shape, rows, n, stages)
    run_dir = args.work / "run"
    harness.prepare(recipe, run_dir)
    harness.train(recipe, "alignment", run_dir)
    harness.train(recipe, "sft", run_dir)
    reset_peak()
    records = harness.train(recipe, "grpo", run_dir)
    split = {key: harness.median_after(records, key, args.warmup)
             for key in ("rollout_s", "logprob_s", "update_s", "refit_s", "rollout_tokens")}
    step_s = split["rollout_s"] + split["logprob_s"] + split["update_s"] + split["refit_s"]
    timed = records[args.warmup:] or records
    stitch = {**split, "step_s": step_s, "rollout_share": split["rollout_s"] / step_s,
              "rollout_tokens_per_s": statistics.median(r["rollout_tokens"] / r["rollout_s"] for r in timed),
              "peak_gib": peak_gib(), "steps": len(timed)}
    log(f"stitch: {json.dumps(stitch)}")
    texts = [json.loads(line) for line in rows.read_text().splitlines()]
    lm, tok = stock_lm(host.get("models", shape.model), shape, lora)
    stock = stock_generate(lm, tok, texts, prompts, group, new_tokens, args)
    ratio = round(stitch["rollout_tokens_per_s"] / stock["tokens_per_s"], 2)
    figures = {"step s": round(step_s, 3), "rollout s": round(split["rollout_s"], 3),
               "log-probs s": round(split["logprob_s"], 3), "update s": round(split["update_s"], 3),
               "rollout tok/s": round(stitch["rollout_tokens_per_s"]), "generate tok/s": round(stock["tokens_per_s"]),
               "rollout vs generate": ratio, "peak GiB": stitch["peak_gib"]}
    return {"model": {"name": shape.model, "encoder": shape.encoder},
            "options": {"prompts": prompts, "group": group, "max_new_tokens": new_tokens, "micro_batch_size": micro},
            "stitch": stitch, "stock_generate": stock, "rollout_vs_generate": ratio,
            "rows": [{"shape": args.shape, "figures": figures}]}


def stock_generate(lm: Any, tok: Any, texts: list[dict], prompts: int, group: int, new_tokens: int,
                   args: argparse.Namespace) -> dict[str, Any]:
    """transformers' sampling `generate` on prompt embeddings (image slots + question), prompts x group rows."""
    dev = harness.device()
    lm.eval()
    questions = [tok(r["question"])["input_ids"] for r in texts[:prompts]]
    width = IMAGE_TOKENS + 2 + max(len(q) for q in questions)
    ids = torch.full((prompts, width), tok.pad_token_id or 0)
    mask = torch.zeros(prompts, width, dtype=torch.long)
    for i, q in enumerate(questions):  # left-padded, as generate expects
        ids[i, width - len(q):] = torch.tensor(q)
        mask[i, width - len(q) - IMAGE_TOKENS - 2:] = 1
    ids, mask = ids.repeat_interleave(group, 0).to(dev), mask.repeat_interleave(group, 0).to(dev)
    counts, times = [], []
    for i in range(args.warmup + args.steps):
        with torch.no_grad():
            embeds = lm.get_input_embeddings()(ids)
            sync()
            t0 = time.perf_counter()
            out = lm.generate(inputs_embeds=embeds, attention_mask=mask, do_sample=True, temperature=1.0,
                              max_new_tokens=new_tokens, pad_token_id=tok.pad_token_id)
            sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            done = (out == tok.eos_token_id).int().cumsum(1) > 0  # tokens after a row's end are padding
            counts.append(int((~done).sum() + done.any(1).sum()))
    return {"tokens_per_s": statistics.median(c / t for c, t in zip(counts, times, strict=True)),
            "tokens_per_call": statistics.median(counts), "seconds_per_call": statistics.median(times)}
