"""SFT tokens/s: the product's SFT stage against stock transformers + peft and a LLaVA-style loop, one process.

stitch: `stitch prepare` + `stitch train alignment` (1 step) + `stitch train sft`, timed by the stage's own
per-step ``tokens_per_s`` (metrics.jsonl). stock: the same base and LoRA, one causal row of the same budget per step
built from the same rows' text tokens, transformers' own loss, AdamW. llava: padded batches of the same rows with
the frozen CLIP tower run on the pixels every step, projector + stock LM + transformers' loss (the encoder-in-the-loop
trainer peers ship). Medians over the timed steps after warm-up.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch

from benchmarks.common import flops_per_token, log, matmul_params, mfu, peak_gib, reset_peak, sync
from benchmarks.suites import harness

IMAGE_TOKENS = 49


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget", type=int, default=None, help="tokens per packed row (default 4096; tiny 512)")
    p.add_argument("--llava-batch", type=int, default=None, help="rows per padded LLaVA step (default 16; tiny 4)")
    p.add_argument("--rows", type=int, default=None, help="dataset rows (default 1024; tiny 64)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    shape = harness.SHAPES[args.shape]
    tiny = args.shape == "tiny"
    budget = args.budget or (512 if tiny else 4096)
    n = args.rows or (64 if tiny else 1024)
    host = harness.install_host()
    rows = harness.write_jpeg_rows(args.work / "data", n, unique=min(n, 64), words=(10, 100))
    lora = {"r": 16, "alpha": 32, "dropout": 0.0}
    stages = {"alignment": {"partition": "alignment", "steps": 1, "batch_size": 1, "token_budget": budget},
              "sft": {"partition": "train", "steps": args.warmup + args.steps, "batch_size": 1, "token_budget": budget,
                      "lr_projector": 1e-3, "lr_adapter": 3e-3, "lora": lora}}
    recipe = harness.write_recipe(args.work, shape, rows, n, stages)
    run_dir = args.work / "run"
    harness.prepare(recipe, run_dir)
    harness.train(recipe, "alignment", run_dir)
    reset_peak()
    records = harness.train(recipe, "sft", run_dir)
    stitch_peak = peak_gib()
    stitch = {"tokens_per_s": harness.median_after(records, "tokens_per_s", args.warmup),
              "tokens_per_step": harness.median_after(records, "tokens", args.warmup),
              "pack_fill": harness.median_after(records, "pack_fill", args.warmup), "peak_gib": stitch_peak,
              "steps": len(records) - args.warmup}
    log(f"stitch: {json.dumps(stitch)}")
    texts = [json.loads(line) for line in rows.read_text().splitlines()]
    spec, encoder = host.get("models", shape.model), host.get("encoders", shape.encoder)
    lm, tok = stock_lm(spec, shape, lora)
    frozen, trainable = matmul_params(lm)
    flops = flops_per_token(frozen, trainable)
    stock = stock_steps(lm, tok, texts, budget, args)
    llava = llava_steps(lm, tok, texts, host, encoder, args.llava_batch or (4 if tiny else 16), args)
    for mode in (stitch, stock, llava):
        mode.update(mfu(flops, mode["tokens_per_s"]))
    ratios = {"stitch_vs_stock": round(stitch["tokens_per_s"] / stock["tokens_per_s"], 3),
              "stitch_vs_llava": round(stitch["tokens_per_s"] / llava["tokens_per_s"], 3)}
    log(f"ratios: {ratios}")
    figures = {"stitch tok/s": round(stitch["tokens_per_s"]), "stock tok/s": round(stock["tokens_per_s"]),
               "llava tok/s": round(llava["tokens_per_s"]), **{k.replace("_", " "): v for k, v in ratios.items()},
               "MFU 6N": stitch["mfu_6n"], "MFU LoRA": stitch["mfu_lora"], "peak GiB": stitch_peak}
    return {"model": {"name": shape.model, "encoder": shape.encoder, "frozen_matmul_params": frozen,
                      "trainable_params": trainable, "flops_per_token": flops, "budget": budget},
            "stitch": stitch, "stock": stock, "llava": llava, "ratios": ratios,
            "rows": [{"shape": args.shape, "figures": figures}]}


def stock_lm(spec: Any, shape: harness.Shape, lora: dict[str, Any]) -> tuple[Any, Any]:
    """The spec's base from its snapshot as plain transformers loads it, with peft's LoRA on the spec's targets."""
    import transformers
    from peft import LoraConfig, get_peft_model

    kwargs = spec.source.pretrained_kwargs()
    dtype = getattr(torch, shape.dtype)
    cls = getattr(transformers, spec.architecture)
    lm = cls.from_pretrained(**kwargs, dtype=dtype, attn_implementation="sdpa").to(harness.device())
    lm.requires_grad_(False)
    lm = get_peft_model(lm, LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=0.0, bias="none",
                                       target_modules=list(spec.lora_target_modules)))
    return lm, transformers.AutoTokenizer.from_pretrained(kwargs["pretrained_model_name_or_path"])


def timed(step: Any, args: argparse.Namespace) -> list[float]:
    times = []
    for i in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return times


def optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, fused=torch.cuda.is_available())


def stock_steps(lm: Any, tok: Any, texts: list[dict], budget: int, args: argparse.Namespace) -> dict[str, Any]:
    """One causal row of ``budget`` tokens a step (the rows' text, concatenated), every token labelled."""
    stream = [t for r in texts for t in tok(r["question"] + " " + r["answer"])["input_ids"]]
    while len(stream) < budget * (args.warmup + args.steps + 1):
        stream += stream
    params = [p for p in lm.parameters() if p.requires_grad]
    opt, cursor = optimizer(params), [0]
    lm.train()
    reset_peak()

    def step() -> None:
        ids = torch.tensor([stream[cursor[0]:cursor[0] + budget]], device=harness.device())
        cursor[0] += budget
        loss = lm(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = timed(step, args)
    return {"tokens_per_s": budget / statistics.median(times), "tokens_per_step": budget, "peak_gib": peak_gib(),
            "steps": len(times)}


def llava_steps(lm: Any, tok: Any, texts: list[dict], host: Any, encoder: Any, batch: int,
                args: argparse.Namespace) -> dict[str, Any]:
    """Padded batches of ``batch`` rows: CLIP on raw pixels each step (penultimate layer, patch tokens), the
    projector, the image tokens scattered into the LM's embeddings, transformers' loss over the answers."""
    from transformers import CLIPVisionModel

    dev = harness.device()
    dtype = next(lm.parameters()).dtype
    clip = CLIPVisionModel.from_pretrained(**encoder.source.pretrained_kwargs(), attn_implementation="sdpa")
    clip = clip.to(dev, dtype).eval().requires_grad_(False)
    hidden = lm.get_input_embeddings().weight.shape[1]
    projector = host.get("projectors", "mlp2x_gelu").build(encoder.feature_width, hidden).to(dev, dtype)
    params = [p for p in lm.parameters() if p.requires_grad] + list(projector.parameters())
    opt, rng = optimizer(params), random.Random(0)
    pixels = torch.randn(8, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    rows = [(tok(r["question"])["input_ids"], tok(" " + r["answer"])["input_ids"]) for r in texts]
    lm.train()
    reset_peak()
    real = []

    def step() -> None:
        group = rng.sample(rows, batch)
        width = max(IMAGE_TOKENS + 2 + len(q) + len(a) for q, a in group)
        ids = torch.zeros(batch, width, dtype=torch.long)
        labels = torch.full((batch, width), -100)
        mask = torch.zeros(batch, width, dtype=torch.long)
        for i, (q, a) in enumerate(group):
            n = IMAGE_TOKENS + 2 + len(q) + len(a)
            ids[i, IMAGE_TOKENS + 2:n] = torch.tensor(q + a)
            labels[i, n - len(a):n] = torch.tensor(a)
            mask[i, :n] = 1
        real.append(int(mask.sum()))
        ids, labels, mask = ids.to(dev), labels.to(dev), mask.to(dev)
        with torch.no_grad():
            pix = pixels[torch.randint(0, 8, (batch,))].to(dev, dtype)
            feats = clip(pixel_values=pix, output_hidden_states=True).hidden_states[-2][:, 1:]
        embeds = lm.get_input_embeddings()(ids)
        embeds = torch.cat([embeds[:, :1], projector(feats), embeds[:, 1 + IMAGE_TOKENS:]], dim=1)
        loss = lm(inputs_embeds=embeds, attention_mask=mask, labels=labels, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = timed(step, args)
    tokens = statistics.median(real[args.warmup:])
    return {"tokens_per_s": tokens / statistics.median(times), "tokens_per_step": tokens, "batch": batch,
            "peak_gib": peak_gib(), "steps": len(times)}
