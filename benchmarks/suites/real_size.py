"""The published shapes at size through the product: `stitch snapshot` -> prepare -> alignment -> SFT -> GRPO.

For each model, a random-init snapshot in its published layout (reused when present; shards past
--disk-budget-gib spill to --spill-dir), a recipe naming it as ``model.snapshot``, then the stages as `stitch train`
runs them. SFT tokens/s (the stage's own metrics) and MFU on active parameters (routed experts count top-k of E),
the GRPO step seconds. `--shape tiny` writes the snapshot narrowed (--layers 4 --width 128) so it runs on a CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import flops_per_token, log, mfu, peak_gib, reset_peak
from benchmarks.suites import harness


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=None, help="comma-separated (default the MoE pair; tiny qwen3.6-35b-a3b)")
    p.add_argument("--layers", type=int, default=None, help="keep this many layers (tiny: 4)")
    p.add_argument("--width", type=int, default=None, help="narrow to this hidden size (tiny: 128)")
    p.add_argument("--budget", type=int, default=None, help="SFT tokens per packed row (default 2048; tiny 512)")
    p.add_argument("--snapshots", type=Path, default=None, help="where snapshots are written and reused")
    p.add_argument("--spill-dir", type=Path, default=None, help="where shards go past --disk-budget-gib")
    p.add_argument("--disk-budget-gib", type=float, default=None)
    p.add_argument("--keep", action="store_true", help="keep each snapshot after its run")


def run(args: argparse.Namespace) -> dict[str, Any]:
    tiny = args.shape == "tiny"
    models = (args.models or ("qwen3.6-35b-a3b" if tiny else "qwen3.6-35b-a3b,nemotron-3.5-lightning-30b-a3b"))
    layers, width = args.layers or (4 if tiny else None), args.width or (128 if tiny else None)
    host = harness.install_host()
    results, rows = {}, []
    for name in models.split(","):
        result = one_model(host, name, layers, width, args)
        results[name] = result
        rows.append({"shape": f"{name}{' (narrow)' if width or layers else ''}", "figures": {
            "SFT tok/s": round(result["sft"]["tokens_per_s"]), "MFU 6N active": result["sft"]["mfu_6n"],
            "GRPO step s": round(result["grpo"]["step_s"], 2), "peak GiB": result["peak_gib"]}})
    return {"layers": layers, "width": width, "models": results, "rows": rows}


def one_model(host: Any, name: str, layers: int | None, width: int | None, args: argparse.Namespace) -> dict:
    from stitch.model.snapshots import write_model_snapshot

    snapshot = (args.snapshots or args.work / "snapshots") / f"{name}-{layers}-{width}"
    if not (snapshot / "config.json").exists():
        write_model_snapshot(host.get("models", name), snapshot, layers=layers, width=width, dtype=torch.bfloat16,
                             spill_dir=args.spill_dir, init_device=harness.device(), progress=log,
                             disk_budget_bytes=None if args.disk_budget_gib is None
                             else int(args.disk_budget_gib * 2**30))
    params = active_params(snapshot)
    spec = host.get("models", name)
    if width:  # the product refuses a snapshot of another width under the published name: register it as its own
        name = f"{name}-w{width}"
        host = harness.install_host((dataclasses.replace(spec, name=name, hidden_size=width),))
    base = harness.SHAPES["tiny" if args.shape == "tiny" else "dense4b"]
    shape = dataclasses.replace(base, model=name, dtype="bfloat16" if torch.cuda.is_available() else "float32")
    work = args.work / name
    n = 64
    rows = harness.write_jpeg_rows(work / "data", n, unique=16, words=(5, 40))
    budget = args.budget or (512 if args.shape == "tiny" else 2048)
    lora = {"r": 16, "alpha": 32, "dropout": 0.0}
    stages = {"alignment": {"partition": "alignment", "steps": 1, "batch_size": 1, "token_budget": budget},
              "sft": {"partition": "train", "steps": args.warmup + args.steps, "batch_size": 1,
                      "token_budget": budget, "lora": lora},
              "grpo": {"partition": "grpo", "steps": 2, "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 16,
                       "lora": lora}}
    recipe = harness.write_recipe(work, shape, rows, n, stages, snapshot=snapshot)
    run_dir = work / "run"
    harness.prepare(recipe, run_dir)
    harness.train(recipe, "alignment", run_dir)
    reset_peak()
    sft = harness.train(recipe, "sft", run_dir)
    grpo = harness.train(recipe, "grpo", run_dir)
    tokens_per_s = harness.median_after(sft, "tokens_per_s", args.warmup)
    # LoRA-aware MFU needs the adapter's size: the stage's model is not reachable from here, so 6N only
    flops = flops_per_token(params["active"], 0)
    result = {"snapshot": str(snapshot), "params": params, "budget": budget, "peak_gib": peak_gib(),
              "sft": {"tokens_per_s": tokens_per_s, "steps": len(sft), **{"mfu_6n": mfu(flops, tokens_per_s)["mfu_6n"]}},
              "grpo": {"step_s": harness.median_after(grpo, "rollout_s", 0) + harness.median_after(grpo, "logprob_s", 0)
                       + harness.median_after(grpo, "update_s", 0),
                       "rollout_tokens": sum(r["rollout_tokens"] for r in grpo)}}
    log(f"{name}: {json.dumps(result)}")
    if not args.keep and args.snapshots is not None and not (layers or width):
        shutil.rmtree(snapshot, ignore_errors=True)
    return result


def active_params(snapshot: Path) -> dict[str, int]:
    """Matmul parameters of the snapshot's model (built on the meta device from its config.json): all of them, and
    active per token (a routed expert's weights count top-k of E)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(snapshot)
    text = config.get_text_config()
    experts = getattr(text, "num_experts", None) or getattr(text, "n_routed_experts", None)
    top_k = getattr(text, "num_experts_per_tok", None)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(text)
    total = active = 0
    for pname, p in model.named_parameters():
        if "embed_tokens" in pname or "embeddings" in pname:
            continue
        share = top_k / experts if experts and top_k and ".experts." in pname and "shared" not in pname else 1.0
        total += p.numel()
        active += int(p.numel() * share)
    return {"matmul_total": total, "active": active}
