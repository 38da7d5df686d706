"""The stock side of the models suite: the same snapshot as a user loads it with transformers + peft, its SFT
step at the suite's batch, and transformers' sampling `generate` for the rollout comparison."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import peak_gib, reset_peak, sync
from benchmarks.suites import harness


def stock_lm(snapshot: Path, spec: Any, lora: dict[str, Any], settings: Any, dtype: str) -> tuple[Any, Any]:
    """The snapshot as a user loads it with transformers, peft's LoRA on the spec's targets, the same
    checkpointing as the stitch run (transformers' own switch)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    lm = transformers.AutoModelForCausalLM.from_pretrained(snapshot, dtype=getattr(torch, dtype),
                                                           device_map=harness.device())
    lm.requires_grad_(False)
    if settings.checkpointing != "off":
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm = get_peft_model(lm, LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=0.0, bias="none",
                                       target_modules=list(spec.lora_target_modules)))
    return lm, transformers.AutoTokenizer.from_pretrained(snapshot)


def stock_sft(lm: Any, tok: Any, data: Path, settings: Any, args: argparse.Namespace) -> dict[str, Any]:
    """``settings.batch`` causal rows of ``budget`` tokens per AdamW step, ``settings.micro`` rows a backward, every
    token labelled; tokens/s over the timed optimizer steps."""
    texts = [json.loads(line) for line in data.read_text().splitlines()]
    stream = [t for r in texts for t in tok(r["question"] + " " + r["answer"])["input_ids"]]
    need = settings.budget * settings.batch * (args.warmup + args.steps + 1)
    stream = (stream * (need // max(len(stream), 1) + 1))[:need]
    params = [p for p in lm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=torch.cuda.is_available())
    rows = torch.tensor(stream).view(-1, settings.budget)
    lm.train()
    reset_peak()
    times, cursor = [], 0
    for i in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        for start in range(0, settings.batch, settings.micro):
            ids = rows[cursor + start:cursor + min(start + settings.micro, settings.batch)].to(harness.device())
            (lm(input_ids=ids, labels=ids, use_cache=False).loss * ids.shape[0] / settings.batch).backward()
        cursor += settings.batch
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return {"tokens_per_s": settings.budget * settings.batch / statistics.median(times), "peak_gib": peak_gib()}


def stock_generate(lm: Any, tok: Any, rows: int, new_tokens: int, args: argparse.Namespace) -> float:
    """transformers' sampling `generate`, ``rows`` prompts of GRPO's prompt length (49 image slots + sentinels +
    a question), to ``new_tokens`` each; tokens/s (tokens after a row's end are padding, not counted)."""
    lm.eval()
    length = 51 + 24
    vocab = lm.get_input_embeddings().num_embeddings
    ids = torch.randint(min(1000, vocab // 2), min(5000, vocab), (rows, length), device=harness.device())
    rates = []
    for i in range(2):
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=tok.pad_token_id)
        sync()
        if i:
            rates.append((out.shape[1] - length) * rows / (time.perf_counter() - t0))
    return statistics.median(rates)
