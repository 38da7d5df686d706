"""The four base models at their published shapes through stitch's real path (issue 16): a random-init snapshot in
the published layout (``stitch snapshot``'s writer, reused when present) -> ``with_local_snapshot`` ->
``ModelBinding.for_spec`` (tokenizer, sentinel resolution) -> ``load_model`` (from_pretrained of the shards, through
the Qwen VLM adapter or stitch's Nemotron-H loader) -> ``build_model`` (LoRA r16 on the ModelSpec's targets +
mlp2x_gelu projector) -> SFT steps on packed rows (``collate_packs`` + ``StitchedModel.loss``, packed when the model
packs on this machine, else one sample per row) -> one GRPO step (``EmbeddedEngine.generate`` -> ``score_rollouts``
-> ``policy_gradients`` -> AdamW) -> ``save_trainable`` -> reload (``build_model(adapter_from, projector_from)`` on
the unloaded base, every trainable tensor compared). Features are random [1, 49, 768] bf16, as the cache returns them;
rewards are seeded random 0/1 (random weights have nothing to verify).

Writes ``benchmarks/results/real_size_<model>.json`` per model: load OK, steps OK, peak GiB (device and host), step
times, and for the MoE pair tokens/s and MFU on active parameters (6 * N_active * tokens / s / 989 TFLOP/s).

On the H200 (torch 2.11, transformers 5.17, peft 0.21; no package index; 64 GiB disk, 128 GiB host memory):

    PYTHONPATH=. python3 benchmarks/real_size.py --models qwen3.5-4b,nemotron-3-nano-4b --snapshots /tmp/snap
    PYTHONPATH=. python3 benchmarks/real_size.py --models qwen3.6-35b-a3b --snapshots /tmp/snap \\
        --spill-dir /dev/shm/snap --disk-budget-gib 34
    PYTHONPATH=. python3 benchmarks/real_size.py --models nemotron-3.5-lightning-30b-a3b --snapshots /tmp/snap \\
        --spill-dir /dev/shm/snap --disk-budget-gib 30

The MoE snapshots (65.4 / 58.8 GiB in bf16) fit neither the disk nor /dev/shm (a tmpfs of half the host memory)
alone: shards past --disk-budget-gib go to --spill-dir and are linked from the snapshot, and the Qwen pair loads
straight onto the GPU (device_map), so the host holds at most the spilled shards. A big snapshot is deleted after
its run unless --keep. CPU smoke test (seconds):

    PYTHONPATH=. python benchmarks/real_size.py --layers 4 --width 128 --out /tmp/bench --snapshots /tmp/snap
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import resource
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import H200_BF16_DENSE_PEAK, log, machine_info, now, peak_gib, reset_peak  # noqa: E402

MODELS = ("qwen3.5-4b", "qwen3.6-35b-a3b", "nemotron-3-nano-4b", "nemotron-3.5-lightning-30b-a3b")
ENCODER, PROJECTOR = "clip-vit-base-patch32", "mlp2x_gelu"
BIG_SNAPSHOT_GIB = 20  # deleted after the run unless --keep


def host_peak_gib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)  # ru_maxrss is KiB on Linux


def snapshot_complete(directory: Path) -> bool:
    """A snapshot the writer finished: config.json (written last) and every shard its index names."""
    if not (directory / "config.json").exists():
        return False
    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = set(json.loads(index.read_text())["weight_map"].values())
        return all((directory / f).exists() for f in files)
    return (directory / "model.safetensors").exists()


def ensure_snapshot(spec, args, rec: dict) -> Path:
    from stitch.model.snapshots import write_model_snapshot

    suffix = "".join(f"-{k}{v}" for k, v in (("l", args.layers), ("w", args.width)) if v is not None)
    directory = Path(args.snapshots) / f"{spec.name}{suffix}"
    if snapshot_complete(directory):
        rec["snapshot"] = {"dir": str(directory), "reused": True}
        return directory
    shutil.rmtree(directory, ignore_errors=True)
    spill = Path(args.spill_dir) / directory.name if args.spill_dir else None
    t = time.perf_counter()
    write_model_snapshot(spec, directory, layers=args.layers, width=args.width, dtype=torch.bfloat16,
                         progress=log, spill_dir=spill,
                         disk_budget_bytes=None if args.disk_budget_gib is None else int(args.disk_budget_gib * 2**30),
                         init_device="cuda" if torch.cuda.is_available() else "cpu")
    index = directory / "model.safetensors.index.json"
    total = json.loads(index.read_text())["metadata"]["total_size"] if index.exists() else \
        (directory / "model.safetensors").stat().st_size
    rec["snapshot"] = {"dir": str(directory), "reused": False, "write_s": round(time.perf_counter() - t, 1),
                       "init_device": "cuda" if torch.cuda.is_available() else "cpu",
                       "gib": round(total / 2**30, 2), "spilled_to": str(spill) if spill else None,
                       "host_peak_gib_after_write": host_peak_gib()}
    return directory


def active_matmul_params(lm, spec) -> tuple[int, int]:
    """(total, active) parameters of the matmuls a token runs through: routed experts count top_k / n_experts of
    their weight, embeddings none (a lookup), everything else in full (attention, mixers, shared expert, head)."""
    cfg = lm.config.get_text_config()
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts", None)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    total = active = 0
    embed = lm.get_input_embeddings().weight
    for name, p in lm.named_parameters():
        if p.dim() < 2 or p is embed or "lora_" in name:
            continue
        n = p.numel()
        total += n
        routed = experts and ".experts." in name + "." and "shared" not in name
        active += n * top_k // experts if routed else n
    if lm.get_output_embeddings() is not None and lm.get_output_embeddings().weight is embed:
        total, active = total + embed.numel(), active + embed.numel()  # a tied head still multiplies
    return total, active


def make_samples(n: int, tokenizer, ids, tokens_per_item: int, lo: int, hi: int, seed: int):
    from stitch.data.packing import Sample

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    out = []
    for i in range(n):
        text = rng.randint(lo, hi)
        prompt = max(1, text // 3)
        body = [vocab[j] for j in torch.randint(0, len(vocab), (text,), generator=gen).tolist()]
        input_ids = [ids.start] + [ids.placeholder] * tokens_per_item + [ids.end] + body
        labels = [-100] * (tokens_per_item + 2 + prompt) + body[prompt:]
        feats = torch.randn(1, tokens_per_item, 768, generator=gen).to(torch.bfloat16)
        out.append(Sample(f"s{i}", input_ids, labels, feats))
    return out


def pack_greedy(samples, budget: int, packed: bool) -> list[list]:
    """Rows of at most ``budget`` tokens: samples concatenated when the model packs, else one per row."""
    if not packed:
        return [[s] for s in samples]
    rows, row, used = [], [], 0
    for s in samples:
        if row and used + len(s.input_ids) > budget:
            rows.append(row)
            row, used = [], 0
        row.append(s)
        used += len(s.input_ids)
    return rows + ([row] if row else [])


def sft_steps(model, binding, spec, args, device, rec: dict) -> None:
    from stitch.data.packing import collate_packs
    from stitch.model.loading import packs_loaded

    packed = packs_loaded(spec, model)
    enc = binding.encoder_spec
    n = args.sft_samples
    samples = make_samples(n, binding.tokenizer, binding.sentinel_ids, enc.tokens_per_item, 64, 400, seed=0)
    rows = pack_greedy(samples, args.budget, packed)[: args.rows] if packed else \
        pack_greedy(samples, args.budget, packed)[: max(1, args.unpacked_rows)]
    groups = [{"params": [p for p in model.projector.parameters() if p.requires_grad], "lr": 1e-4},
              {"params": [p for n_, p in model.named_parameters() if p.requires_grad and "lora_" in n_], "lr": 1e-4}]
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    times, losses = [], []
    reset_peak()
    model.train()
    for _ in range(args.sft_steps):
        t = now()
        batch = collate_packs(rows, binding.pad_id, packed, length=None).to(device)
        loss, _ = model.loss(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], 1.0)
        optimizer.step()
        times.append(now() - t)
        losses.append(round(float(loss.detach()), 4))
    tokens = int(batch.tokens)
    rec["sft"] = {"packed": packed, "rows": len(rows), "samples": sum(len(r) for r in rows), "tokens": tokens,
                  "step_s": [round(x, 4) for x in times], "loss": losses, "peak_gib": peak_gib()}
    timed = times[1:] or times  # the first step pays one-off kernel selection
    step_s = sum(timed) / len(timed)
    rec["sft"]["tokens_per_s"] = round(tokens / step_s, 1)
    total, active = rec["params"]["matmul_total"], rec["params"]["matmul_active"]
    rec["sft"]["mfu_active_6n"] = round(6 * active * tokens / step_s / H200_BF16_DENSE_PEAK, 4)
    rec["sft"]["mfu_total_6n"] = round(6 * total * tokens / step_s / H200_BF16_DENSE_PEAK, 4)
    del optimizer


def grpo_step(model, binding, args, device, rec: dict) -> None:
    from stitch.config.options import GRPOOptions
    from stitch.data.packing import Sample
    from stitch.rollout.engines import EmbeddedEngine
    from stitch.stages.grpo import group_advantages, micro_batches, policy_gradients, score_rollouts

    opts = GRPOOptions(prompts_per_step=args.prompts, group_size=args.group, max_new_tokens=args.max_new_tokens)
    enc = binding.encoder_spec
    prompts = make_samples(opts.prompts_per_step, binding.tokenizer, binding.sentinel_ids, enc.tokens_per_item,
                           24, 40, seed=1)
    model.projector.requires_grad_(False)  # GRPOOptions.train_projector defaults to False
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    reference = {n: p.detach().clone() for n, p in trainable.items()}
    optimizer = torch.optim.AdamW(list(trainable.values()), lr=opts.lr_adapter, weight_decay=0.0)
    sentinels = list(binding.sentinel_ids.as_dict().values())
    engine = EmbeddedEngine(model.lm, pad_id=binding.pad_id, eos_id=binding.tokenizer.eos_token_id,
                            suppress_ids=sentinels)
    reset_peak()
    parts = {}
    t = now()
    model.eval()
    with torch.no_grad():
        embeds = [model.embed(torch.tensor([s.input_ids], device=device), s.features.to(device), [s.row_id])[0]
                  for s in prompts]
        completions = engine.generate(embeds, opts.group_size, opts.max_new_tokens, opts.temperature)
    parts["rollout_s"] = now() - t
    t = now()
    rewards = torch.randint(0, 2, (len(completions),), generator=torch.Generator().manual_seed(0)).float()
    adv = group_advantages(rewards, opts.group_size).to(device)
    samples = [[Sample(prompts[c.prompt_index].row_id, prompts[c.prompt_index].input_ids + c.token_ids,
                       [-100] * len(prompts[c.prompt_index].input_ids) + c.token_ids, prompts[c.prompt_index].features)]
               for c in completions]
    chunks, batches = micro_batches(samples, binding.pad_id, opts.micro_batch_size, device)
    old_lp, ref_lp, mask = score_rollouts(model, batches, opts.temperature, reference, sentinels)
    parts["logprobs_s"] = now() - t
    t = now()
    loss, _ = policy_gradients(model, chunks, batches, old_lp, ref_lp, adv, mask, opts, sentinels)
    torch.nn.utils.clip_grad_norm_(list(trainable.values()), opts.grad_clip or float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    parts["train_s"] = now() - t
    rec["grpo"] = {**{k: round(v, 4) for k, v in parts.items()}, "step_s": round(sum(parts.values()), 4),
                   "sequences": len(completions), "gen_tokens": int(mask.sum()), "loss": round(float(loss), 5),
                   "peak_gib": peak_gib()}
    del optimizer, reference


def save_and_reload(model, binding, out: Path, rec: dict):
    step = out / "step"
    t = now()
    binding.save_trainable(model, step, stage="sft")
    saved = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()
             if "lora_" in n or n.startswith("projector.")}
    base = model.lm.unload()  # the frozen base without LoRA layers: a second copy of a 35B would not fit
    del model
    gc.collect()
    reloaded = binding.build_model(adapter_from=step / "adapter", projector_from=step / "projector", lm=base)
    got = {n: p.detach().float().cpu() for n, p in reloaded.named_parameters()
           if "lora_" in n or n.startswith("projector.")}
    mismatched = sorted(n for n in saved if n not in got or not torch.equal(saved[n], got[n]))
    rec["save_reload"] = {"s": round(now() - t, 3), "tensors": len(saved), "mismatched": mismatched[:5],
                          "ok": not mismatched and set(saved) == set(got)}
    return reloaded


def run_model(name: str, args, host, device, backend: str = "transformers", last: bool = True) -> dict:
    """One model on one backend; ``last``: no other backend runs on this snapshot after it (a big one may go)."""
    from stitch.config.options import LoraOptions
    from stitch.model.binding import ModelBinding, resolved_lora_targets
    from stitch.model.loading import load_model, refused_by_backend, with_backend, with_local_snapshot

    rec: dict = {"model": name, "backend": backend, "layers": args.layers, "width": args.width, "stage": "snapshot",
                 "load_ok": False, "steps_ok": False}
    out = Path(args.work) / name
    shutil.rmtree(out, ignore_errors=True)
    try:
        spec = with_backend(host.get("models", name), backend)  # refused here when the backend cannot run
        directory = ensure_snapshot(spec, args, rec)
        if args.width is not None:  # a narrowed smoke snapshot: the spec's width follows it (full size: never)
            spec = dataclasses.replace(spec, hidden_size=args.width)
        rec["stage"] = "load"
        spec = with_local_snapshot(spec, directory)
        binding = ModelBinding.for_spec(host, spec, ENCODER, PROJECTOR, torch.bfloat16, device)
        rec["sentinel_ids"] = binding.sentinel_ids.as_dict()
        reset_peak()
        t = now()
        lm = load_model(spec, dtype=torch.bfloat16, device=str(device) if device.type == "cuda" else None)
        lm.requires_grad_(False)
        rec["load_s"] = round(now() - t, 2)
        total, active = active_matmul_params(lm, spec)
        rec["params"] = {"total": sum(p.numel() for p in lm.parameters()), "matmul_total": total,
                         "matmul_active": active}
        rec["architecture"] = type(lm).__name__
        model = binding.build_model(lora=LoraOptions(r=16, alpha=32), lm=lm)
        if args.grad_ckpt:
            model.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.lm.enable_input_require_grads()
        rec["load_peak_gib"] = peak_gib()
        rec["lora"] = {"targets": list(spec.lora_target_modules), "resolved": sorted(resolved_lora_targets(model.lm)),
                       "params": sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)}
        rec["load_ok"] = True
        rec["stage"] = "sft"
        sft_steps(model, binding, spec, args, device, rec)
        rec["stage"] = "grpo"
        cannot = refused_by_backend(spec, "generate")
        if cannot:
            rec["grpo"] = {"skipped": cannot}
        else:
            grpo_step(model, binding, args, device, rec)
        rec["stage"] = "save_reload"
        model = save_and_reload(model, binding, out, rec)
        rec["steps_ok"] = rec["save_reload"]["ok"]
        rec["stage"] = "done"
        del model, lm
    except Exception as exc:  # noqa: BLE001 - the result records where and why a model failed; the next one runs
        rec["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        rec["traceback"] = traceback.format_exc()[-4000:]
        log(f"{name}: failed at {rec['stage']}: {rec['error'][:300]}")
    peaks = [rec.get(k, {}).get("peak_gib") for k in ("sft", "grpo")] + [rec.get("load_peak_gib")]
    peaks = [p for p in peaks if p is not None]  # None off the GPU: host_peak_gib is the figure there
    rec["peak_gib"] = max(peaks) if peaks else None
    rec["host_peak_gib"] = host_peak_gib()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    snap = rec.get("snapshot", {})
    if last and not args.keep and snap.get("gib", 0) > BIG_SNAPSHOT_GIB:
        shutil.rmtree(snap["dir"], ignore_errors=True)
        if snap.get("spilled_to"):
            shutil.rmtree(snap["spilled_to"], ignore_errors=True)
    return rec


def compare_backends(name: str, runs: dict[str, dict]) -> dict:
    """One record for a model measured on several backends: each run whole under ``backends``, and the figures to
    compare side by side (tokens/s and MFU on active parameters of the SFT steps, their step time, peaks)."""
    first = next(iter(runs.values()))
    return {
        "model": name, "layers": first.get("layers"), "width": first.get("width"),
        "load_ok": all(r["load_ok"] for r in runs.values()), "steps_ok": all(r["steps_ok"] for r in runs.values()),
        "peak_gib": max((r["peak_gib"] for r in runs.values() if r.get("peak_gib") is not None), default=None),
        "host_peak_gib": max(r["host_peak_gib"] for r in runs.values()),
        "load_s": {b: r.get("load_s") for b, r in runs.items()}, "stage": {b: r["stage"] for b, r in runs.items()},
        "error": {b: r["error"] for b, r in runs.items() if "error" in r} or None,
        "comparison": {b: {"packed": r.get("sft", {}).get("packed"), "tokens": r.get("sft", {}).get("tokens"),
                           "tokens_per_s": r.get("sft", {}).get("tokens_per_s"),
                           "mfu_active_6n": r.get("sft", {}).get("mfu_active_6n"),
                           "step_s": r.get("sft", {}).get("step_s"), "peak_gib": r.get("peak_gib"),
                           "loss": r.get("sft", {}).get("loss")} for b, r in runs.items()},
        "backends": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated ModelSpec names")
    parser.add_argument("--layers", type=int, default=None, help="keep this many layers (smoke tests)")
    parser.add_argument("--width", type=int, default=None, help="narrow to this hidden size (smoke tests)")
    parser.add_argument("--snapshots", default="/tmp/stitch-snapshots", help="where snapshots are written/reused")
    parser.add_argument("--spill-dir", default=None, help="shards past --disk-budget-gib go here (e.g. /dev/shm)")
    parser.add_argument("--disk-budget-gib", type=float, default=None)
    parser.add_argument("--keep", action="store_true", help="keep snapshots over 20 GiB after their run")
    parser.add_argument("--work", default="/tmp/stitch-real-size", help="adapter/projector artifacts")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--budget", type=int, default=2048, help="token budget of a packed row")
    parser.add_argument("--rows", type=int, default=1, help="packed rows per SFT step")
    parser.add_argument("--unpacked-rows", type=int, default=4, help="rows per SFT step when the model cannot pack")
    parser.add_argument("--sft-samples", type=int, default=32)
    parser.add_argument("--sft-steps", type=int, default=3, help="SFT steps; the first is not averaged")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--no-grad-ckpt", dest="grad_ckpt", action="store_false")
    parser.add_argument("--backends", default="transformers",
                        help="comma-separated model.backend values measured one after another on the same snapshot "
                             "(e.g. transformers,automodel); with more than one the JSON holds each under 'backends'")
    args = parser.parse_args()
    from benchmarks.sft_throughput import plugin_host

    host = plugin_host()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    failed = False
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for name in args.models.split(","):
        log(f"== {name}")
        runs = {}
        for i, backend in enumerate(backends):
            log(f"-- {name} on {backend}")
            runs[backend] = run_model(name.strip(), args, host, device, backend, last=i == len(backends) - 1)
            partial = runs[backend] if len(runs) == 1 else compare_backends(name.strip(), runs)
            # written after every backend: a call cut short by its time limit keeps the backends it finished
            (out / f"real_size_{name.strip()}.json").write_text(json.dumps({**partial, "machine": info}, indent=2)
                                                               + "\n")
            gc.collect()  # the previous backend's model is gone before the next one loads
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        rec = runs[backends[0]] if len(backends) == 1 else compare_backends(name.strip(), runs)
        rec["machine"] = info
        (out / f"real_size_{name.strip()}.json").write_text(json.dumps(rec, indent=2) + "\n")
        log(json.dumps({k: rec.get(k) for k in ("model", "load_ok", "steps_ok", "peak_gib", "host_peak_gib",
                                                 "load_s", "stage", "error")}))
        failed |= not rec["steps_ok"]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
