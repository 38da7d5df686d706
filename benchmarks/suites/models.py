"""The four seed models at their published shapes: `stitch train sft` / `stitch train grpo` against stock
transformers + peft (same kernels installed, same process, same tokens per optimizer step).

Per model: a random-init snapshot in the published layout (`stitch snapshot`'s writer; shards past
--disk-budget-gib spill to --spill-dir), a recipe naming it as ``model.snapshot`` with the batch, accumulation and
checkpointing of ``SETTINGS``, then prepare -> alignment (1 step) -> SFT -> GRPO as `stitch train` runs them, timed
by the stages' own metrics. Stock: ``AutoModelForCausalLM.from_pretrained`` of the same snapshot, peft LoRA r16 on
the spec's targets, one causal row of ``budget`` tokens per micro-step, the same micro-steps per AdamW step and the
same checkpointing; stock `generate` for the rollout comparison (prompt ids of the GRPO prompts' lengths).
MFU both ways: 6N on active parameters (routed experts count top-k of E) and LoRA-aware (4N frozen + 6N trainable).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import commit, flops_per_token, log, mfu, peak_gib, reset_peak, write_suite
from benchmarks.suites import harness
from benchmarks.suites.real_size import active_params
from benchmarks.suites.stock import stock_generate, stock_lm, stock_sft

MODELS = ("qwen3.5-4b", "nemotron-3-nano-4b", "qwen3.6-35b-a3b", "nemotron-3.5-lightning-30b-a3b")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a user runs on one H200: tokens per packed row, rows per optimizer step, rows per forward/backward,
    and GRPO's sequences per forward/backward (64 rollouts a step)."""

    budget: int = 4096
    batch: int = 4
    micro: int = 1
    checkpointing: str = "off"
    grpo_micro: int = 8


SETTINGS = {
    "qwen3.5-4b": Settings(),
    "nemotron-3-nano-4b": Settings(),
    "qwen3.6-35b-a3b": Settings(checkpointing="full"),
    "nemotron-3.5-lightning-30b-a3b": Settings(checkpointing="full"),
}
TINY = Settings(budget=512, batch=2, micro=1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=None, help="comma-separated (default all four; tiny qwen3.5-4b)")
    p.add_argument("--snapshots", type=Path, default=None, help="where snapshots are written and reused")
    p.add_argument("--spill-dir", type=Path, default=None, help="where shards go past --disk-budget-gib")
    p.add_argument("--disk-budget-gib", type=float, default=None)
    p.add_argument("--grpo-steps", type=int, default=None, help="timed GRPO steps (default 3; tiny 1)")
    p.add_argument("--skip-stock", action="store_true", help="stitch only (no stock SFT/generate)")
    p.add_argument("--stock-budget", type=int, default=None, help="stock's first tokens a row (default the "
                   "suite's budget; halved on running out of memory)")
    p.add_argument("--train-lm", choices=("lora", "full"), default="lora", help="full: SFT trains every LM weight "
                   "(recorded as '<model> (full fine-tune)' with the stage's memory estimate beside its peak; no "
                   "GRPO, which refuses a full fine-tune, and no stock run)")
    p.add_argument("--grpo-micro", type=int, default=None, help="GRPO sequences a forward/backward (default 8)")
    p.add_argument("--keep", action="store_true", help="keep each snapshot after its run")
    p.add_argument("--profile", action="store_true", help="two more SFT steps and one more GRPO step under the "
                   "stages' profile_steps (not timed); their top operators go into the JSON")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Each model in turn; models.json is rewritten after each phase of each model (a stage's figures, the stock
    figures), so a call cut off by its time limit still brings back what it measured."""
    tiny = args.shape == "tiny"
    names = (args.models or ("qwen3.5-4b" if tiny else ",".join(MODELS))).split(",")
    results = earlier_models(args.out / "models.json", tiny)

    partial: dict[str, Any] = {}

    def save(name: str, result: dict[str, Any]) -> None:
        partial[name] = results[name] = {**result, "partial": True, "measured": measured_here()}
        write_suite(args, {"models": results, "rows": rows_of(results, tiny)})

    for name in names:
        key = name + (" (full fine-tune)" if args.train_lm == "full" else "")
        try:
            result = one_model(name, args, lambda figures, key=key: save(key, figures))
        except Exception as exc:  # one model's failure is a result too (beside what it measured); the others run
            log(f"{key}: FAILED {type(exc).__name__}: {exc}")
            result = {**partial.get(key, {}), "error": f"{type(exc).__name__}: {str(exc)[:500]}"}
        results[key] = {**result, "measured": measured_here()}
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return {"models": results, "rows": rows_of(results, tiny)}


def rows_of(results: dict[str, Any], tiny: bool) -> list[dict[str, Any]]:
    """The RESULTS.md rows: one per model measured, the four seed models first; a model cut off mid-run says so."""
    rows = []
    for name in [m for m in MODELS if m in results] + [m for m in results if m not in MODELS]:
        result = results[name]
        if "sft" in result:
            sft, grpo = result["sft"], result.get("grpo", {})
            cut_off = result.get("partial") or "error" in result
            shape = name + (" (narrow)" if tiny else "") + (" (cut off)" if cut_off else "")
            rows.append({"shape": shape, "figures": {
                "SFT tok/s": round(sft["stitch_tokens_per_s"]), "stock tok/s": _round(sft["stock_tokens_per_s"]),
                "vs stock": sft.get("vs_stock"), "MFU 6N": sft["mfu_6n"], "MFU LoRA": sft["mfu_lora"],
                "SFT GiB": sft["peak_gib"], "rollout row-steps/s": _round(grpo.get("rollout_row_steps_per_s")),
                "generate tok/s": _round(grpo.get("generate_tokens_per_s")), "vs generate": grpo.get("rollout_vs_generate"),
                "rollout share": grpo.get("rollout_share")}, "measured": result.get("measured")})
    return rows


def earlier_models(path: Path, tiny: bool) -> dict[str, Any]:
    """The models an earlier call measured at the same shape and that this one does not rerun: one GPU call per
    model fills the one models.json. Each entry keeps the commit, date and GPU it was measured on."""
    if not path.exists():
        return {}
    doc = json.loads(path.read_text())
    if (doc.get("config", {}).get("shape") == "tiny") != tiny:
        return {}
    return {name: result for name, result in doc.get("models", {}).items() if "measured" in result}


def measured_here() -> dict[str, Any]:
    """Where and when a model's figures were taken (the document's own commit is the last call's)."""
    return {"commit": commit(), "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def allocated_gib() -> float | None:
    """What live tensors hold now: what a stage left behind when read between stages."""
    return round(torch.cuda.memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None


def memory_estimate(summary: dict[str, Any]) -> dict[str, Any]:
    """The stage's own estimate of its training state (weights, gradients, AdamW moments) and that state as the
    first optimizer step held it, to set beside its peak (the rest of which is activations)."""
    est, held = summary.get("memory_estimate"), summary.get("memory_held_bytes")
    out = {"memory_estimate_gib": round(est["bytes"] / 2**30, 2), "memory_estimate": est["arithmetic"]} if est else {}
    return out if held is None else {**out, "memory_held_gib": round(held / 2**30, 2)}


def _round(value: float | None) -> int | None:
    return None if value is None else round(value)


def sft_flops(active: int, trainable: dict[str, int]) -> dict[str, int]:
    """Training FLOPs per token of an SFT run whose stage trained ``trainable`` (its summary's parameters by group)
    on an LM of ``active`` matmul parameters a token. Adapters and the projector are work beside the frozen LM; a
    full fine-tune trains the LM's weights themselves (its "lm" group, those plus the embedding table), so none are
    frozen and they are not counted twice."""
    extra = trainable.get("projector", 0) + trainable.get("adapter", 0)
    if trainable.get("lm", 0):
        return flops_per_token(0, active + extra)
    return flops_per_token(active, extra)


def one_model(name: str, args: argparse.Namespace, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    from stitch.model.snapshots import write_model_snapshot

    tiny = args.shape == "tiny"
    settings = TINY if tiny else SETTINGS[name]
    settings = dataclasses.replace(settings, grpo_micro=args.grpo_micro or settings.grpo_micro)
    host = harness.install_host()
    snapshot = (args.snapshots or args.work / "snapshots") / (f"{name}-narrow" if tiny else name)
    if not (snapshot / "config.json").exists():
        t0 = time.perf_counter()
        write_model_snapshot(host.get("models", name), snapshot, layers=4 if tiny else None,
                             width=128 if tiny else None, dtype=torch.bfloat16, spill_dir=args.spill_dir,
                             init_device=harness.device(), progress=log,
                             disk_budget_bytes=None if args.disk_budget_gib is None
                             else int(args.disk_budget_gib * 2**30))
        log(f"{name}: snapshot written in {time.perf_counter() - t0:.0f} s")
    spec = host.get("models", name)
    model, full = name, args.train_lm == "full"
    if tiny:  # the product refuses a narrowed snapshot under the published name: register it as its own
        model = f"{name}-w128"
        host = harness.install_host((dataclasses.replace(spec, name=model, hidden_size=128),))
    base = harness.SHAPES["tiny" if tiny else "dense4b"]
    shape = dataclasses.replace(base, model=model, dtype="bfloat16" if torch.cuda.is_available() else "float32")
    work = args.work / (name + ("-full" if full else ""))
    n = 128 if tiny else 512
    data = harness.write_jpeg_rows(work / "data", n, unique=min(n, 64), words=(5, 60) if tiny else (40, 400))
    lora = {"r": 16, "alpha": 32, "dropout": 0.0}
    prompts, group, new_tokens = (2, 2, 16) if tiny else (8, 8, 128)
    grpo_steps = args.grpo_steps or (1 if tiny else 3)
    sft_steps = args.warmup + args.steps
    extra = {"sft": 2, "grpo": 1} if args.profile else {"sft": 0, "grpo": 0}
    stages = {
        "alignment": {"partition": "alignment", "steps": 1, "batch_size": 1, "token_budget": settings.budget},
        "sft": {"partition": "train", "steps": sft_steps + extra["sft"], "batch_size": settings.batch,
                "micro_batch_size": settings.micro, "token_budget": settings.budget,
                **({"train_lm": "full"} if full else {"lora": lora}),
                "activation_checkpointing": settings.checkpointing, "buffer_size": 256},
        "grpo": {"partition": "grpo", "steps": 1 + grpo_steps + extra["grpo"], "prompts_per_step": prompts,
                 "group_size": group,
                 "max_new_tokens": new_tokens, "micro_batch_size": settings.grpo_micro, "temperature": 1.0, "lora": lora,
                 "activation_checkpointing": settings.checkpointing}}
    if full:
        del stages["grpo"]
    if args.profile:  # the profiled steps come after the timed ones and are left out of the medians
        stages["sft"]["profile_steps"] = [sft_steps + 1, sft_steps + 2]
        if "grpo" in stages:
            stages["grpo"]["profile_steps"] = [2 + grpo_steps] * 2
    recipe = harness.write_recipe(work, shape, data, n, stages, snapshot=snapshot)
    run_dir = work / "run"
    harness.prepare(recipe, run_dir)
    harness.train(recipe, "alignment", run_dir)
    reset_peak()
    sft_records = harness.train(recipe, "sft", run_dir)[:sft_steps]
    sft_peak = peak_gib()
    summary = json.loads((run_dir / "sft" / "summary.json").read_text())
    trainable = sum(summary["trainable_parameters"].values())
    params = active_params(snapshot)
    flops = sft_flops(params["active"], summary["trainable_parameters"])
    stitch_tps = harness.median_after(sft_records, "tokens_per_s", args.warmup)
    sft = {"stitch_tokens_per_s": stitch_tps, "stitch_stage_tokens_per_s": summary.get("tokens_per_s"),
           "stitch_stage_steady_tokens_per_s": summary.get("steady_tokens_per_s"),
           "tokens_per_optimizer_step": harness.median_after(sft_records, "tokens", args.warmup),
           "settings": dataclasses.asdict(settings), "peak_gib": sft_peak, **mfu(flops, stitch_tps),
           "stock_tokens_per_s": None, **memory_estimate(summary)}
    if "profile" in summary:
        sft["profile_top"] = summary["profile"]["top"]
    log(f"{name} sft: {json.dumps(sft)}")
    params_of = {"snapshot": str(snapshot), "params": params, "trainable": trainable}
    grpo: dict[str, Any] = {"generate_tokens_per_s": None}
    save({**params_of, "sft": sft, "grpo": grpo})
    if full:  # GRPO refuses a full fine-tune; the stock side compares LoRA runs
        return {**params_of, "sft": sft}
    gc.collect()
    grpo["allocated_gib_before"] = allocated_gib()
    try:  # stitch's GRPO before stock loads anything: its peak is its own
        grpo.update(stitch_grpo(recipe, run_dir, prompts * group, 1 + grpo_steps))
    except torch.OutOfMemoryError as exc:  # recorded with where the memory was, the other figures still stand
        grpo["error"] = f"OutOfMemoryError: {str(exc)[:300]}"
        grpo["memory"] = torch.cuda.memory_summary(abbreviated=True)[-3000:]
        log(grpo["memory"])
    log(f"{name} stitch grpo: {json.dumps({k: v for k, v in grpo.items() if k != 'memory'})}")
    save({**params_of, "sft": sft, "grpo": grpo})
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if not args.skip_stock:
        sft["allocated_gib_before_stock"] = allocated_gib()
        lm, tok = stock_lm(snapshot, spec, lora, settings, shape.dtype)
        budget = args.stock_budget or settings.budget
        while sft["stock_tokens_per_s"] is None and budget >= 512:
            try:  # out of memory: the largest row of a power-of-two fraction that fits (recorded beside the figure)
                stock = stock_sft(lm, tok, data, dataclasses.replace(settings, budget=budget), args)
                sft.update(stock_tokens_per_s=stock["tokens_per_s"], stock_peak_gib=stock["peak_gib"],
                           stock_row_tokens=budget, vs_stock=round(stitch_tps / stock["tokens_per_s"], 3),
                           stock_mfu_6n=mfu(flops, stock["tokens_per_s"])["mfu_6n"])
                log(f"{name} stock sft at {budget} tokens a row: {json.dumps(stock)}")
                save({**params_of, "sft": sft, "grpo": grpo})
            except torch.OutOfMemoryError as exc:
                sft.setdefault("stock_errors", []).append(f"{budget} tokens a row: OutOfMemoryError: {str(exc)[:200]}")
                log(f"{name} stock: {sft['stock_errors'][-1]}")
                budget //= 2
                gc.collect()
                torch.cuda.empty_cache() if torch.cuda.is_available() else None
        try:
            grpo["generate_tokens_per_s"] = stock_generate(lm, tok, prompts * group, new_tokens, args)
        except torch.OutOfMemoryError as exc:
            grpo["generate_error"] = f"OutOfMemoryError: {str(exc)[:300]}"
            log(f"{name} generate: {grpo['generate_error']}")
        lm = tok = None
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if grpo.get("generate_tokens_per_s") and grpo.get("rollout_row_steps_per_s"):
        grpo["rollout_vs_generate"] = round(grpo["rollout_row_steps_per_s"] / grpo["generate_tokens_per_s"], 2)
    log(f"{name} grpo: {json.dumps({k: v for k, v in grpo.items() if k != 'memory'})}")
    result = {**params_of, "sft": sft, "grpo": grpo}
    log(f"{name}: {json.dumps(result)}")
    if not args.keep and not tiny and args.snapshots is not None:
        shutil.rmtree(snapshot, ignore_errors=True)
    return result


def stitch_grpo(recipe: Path, run_dir: Path, rows: int, timed_steps: int) -> dict[str, Any]:
    """`stitch train grpo` after SFT: medians of the step parts over the steps after the first. Two rollout rates:
    sampled tokens a second (completions end at EOS), and row-steps a second (``rows`` x the longest completion:
    what the decoder ran, comparable with `generate` run to a fixed length). Steps past ``timed_steps`` are the
    profiled ones."""
    reset_peak()
    records = harness.train(recipe, "grpo", run_dir)
    timed = records[1:timed_steps] or records
    parts = {k: statistics.median(r[k] for r in timed) for k in ("rollout_s", "logprob_s", "update_s", "refit_s")}
    step_s = sum(parts.values())
    summary = json.loads((run_dir / "grpo" / "summary.json").read_text())
    return {**parts, "step_s": step_s, "rollout_share": round(parts["rollout_s"] / step_s, 3),
            "rollout_tokens_per_s": statistics.median(r["rollout_tokens"] / r["rollout_s"] for r in timed),
            "rollout_row_steps_per_s": statistics.median(rows * r["rollout_steps"] / r["rollout_s"] for r in timed),
            "capped_share": statistics.median(r["capped_share"] for r in timed),
            "decode_path": summary.get("decode_path"), "peak_gib": peak_gib(),
            **({"profile_top": summary["profile"]["top"]} if "profile" in summary else {})}
