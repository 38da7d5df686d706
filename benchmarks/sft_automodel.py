"""SFT step throughput of NeMo AutoModel 0.7.0's own Qwen3.5 class (``model.backend: automodel``) beside stitch's
shipped path and stock transformers: one snapshot, one process, the same weights, LoRA, optimizer and samples
(issue 14, point 4).

The shape is sft_throughput's ``qwen35_4b`` (Qwen3.5-4B: hidden 2560, 32 layers, 3 Gated DeltaNet : 1 full
attention, vocab 248,320, tied). Its random-init weights are written once as an HF-format text snapshot
(``write_random_weights``, initialised on the GPU when there is one) into a temporary folder (/dev/shm when it has
room, else /tmp; deleted at the end unless ``--keep-snapshot``); both backends load from it through stitch's
``load_model``, and sft_throughput's ``build_stitched`` puts the same projector (``mlp2x_gelu``, seeded) and LoRA
(r 16 / alpha 32 on the backend's ``lora_target_modules``; both backends name the same nine Qwen3.5 projections)
with the same AdamW groups on each. Modes (sft_throughput's ``run_mode`` / ``run_stock``, the same samples):

* ``packed``     stitch as shipped on the transformers backend: ``--rows`` packs of ``--budget`` tokens
                 (sft_throughput's ``packed``; packed with sample starts only with fla on a GPU).
* ``padded``     the same model on ``--baseline-batch`` samples a step, one per right-padded row (sft_throughput's
                 ``cached_padded``): the rows the AutoModel backend gets, so ``automodel / padded`` compares the two
                 model implementations alone.
* ``stock``      plain transformers + peft on one causal row of ``--budget`` tokens (sft_throughput's ``stock``).
* ``automodel``  stitch with ``model.backend: automodel``: AutoModel's Qwen3_5ForCausalLM under stitch's projector,
                 scatter, LoRA and loss, on ``padded``'s rows (the backend refuses packing: ``REFUSES['packing']``).

Equal-loss guard: before any step, both models' loss on the first padded batch (LoRA B is zero at init, so it is
the base models that are compared); the run exits 1 when they differ by more than ``--loss-rtol`` (relative).
Without nemo_automodel importable, ``automodel`` is skipped with the reason and the rest is still measured/written.

Writes ``sft_qwen35_4b_automodel{--tag}.json`` (``benchmarks.common.write_result``, after every mode) and prints a
table. On the H200 (about 3 minutes; fla and AutoModel installed by ``bash benchmarks/h200_issue14.sh automodel``):

    PYTHONPATH=/tmp/site:/tmp/fla:/tmp/am:. python3 benchmarks/sft_automodel.py --out $OUT
    # CPU check, tiny Qwen3.5 widths, well under 2 minutes:
    PYTHONPATH=.:/tmp/am python benchmarks/sft_automodel.py --smoke --out /tmp/bench
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.metadata
import json
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import log, write_result  # noqa: E402
from benchmarks.sft_throughput import (  # noqa: E402
    build_lm,
    build_stitched,
    kernel_report,
    make_samples,
    plugin_host,
    run_mode,
    run_stock,
)

SHAPE = "qwen35_4b"
MODES = ("packed", "padded", "stock", "automodel")


# -- the snapshot ------------------------------------------------------------------------------------------------


def snapshot_root(need_bytes: int) -> Path:
    """/dev/shm when it holds twice the snapshot (it is host memory), else /tmp."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 2 * need_bytes:
        return shm
    return Path(tempfile.gettempdir())


def write_shape_snapshot(args, root: Path | None) -> tuple[Path, dict]:
    """The shape's config with seeded random-init bf16 weights as an HF text-layout snapshot (config.json last)."""
    from stitch.model.snapshots import write_random_weights

    cls, cfg, _ = build_lm(SHAPE, args.smoke)
    cfg.dtype = torch.bfloat16
    with torch.device("meta"):
        model = cls._from_config(cfg, dtype=torch.bfloat16)
    size = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied head is counted once
    directory = Path(tempfile.mkdtemp(prefix="stitch-sft-automodel-", dir=root or snapshot_root(size)))
    init_device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    write_random_weights(model, directory, init_device=init_device, progress=log)
    model.config.save_pretrained(directory)
    record = {"dir": str(directory), "gib": round(size / 2**30, 2), "init_device": init_device,
              "write_s": round(time.perf_counter() - t0, 1)}
    log(f"snapshot: {json.dumps(record)}")
    return directory, record


def load_stitched(host, snapshot: Path, backend: str, args, device):
    """stitch's ``load_model`` on ``backend`` from ``snapshot``, then sft_throughput's projector + LoRA + AdamW."""
    from stitch.model.loading import load_model, with_backend, with_local_snapshot

    _, cfg, spec_name = build_lm(SHAPE, args.smoke)
    spec = with_backend(host.get("models", spec_name), backend)  # BackendError when the backend cannot import
    if args.smoke:  # the narrowed smoke shape: the spec's width follows it (at full size they agree)
        spec = dataclasses.replace(spec, hidden_size=cfg.hidden_size)
    t0 = time.perf_counter()
    lm = load_model(with_local_snapshot(spec, snapshot), dtype=torch.bfloat16,
                    device=str(device) if device.type == "cuda" else None)
    load_s = round(time.perf_counter() - t0, 1)
    model, optimizer, groups, ids, info = build_stitched(SHAPE, args, host, device, lm=lm, spec=spec)
    info.update(backend=backend, load_s=load_s, linear_attention_kernels=linear_attention_kernels(lm))
    chosen = getattr(lm, "backend", None)  # AutoModel's BackendConfig, as stitch.model.automodel picks it
    if backend != "transformers" and chosen is not None:
        # sft_throughput reads these off transformers' config and stitch's kernels, which this class has neither of
        info.update(attn_implementation=chosen.attn, packed_attention=None, recurrent_layers_path=None,
                    automodel_backend_config={k: str(getattr(chosen, k)) for k in
                                              ("attn", "linear", "rms_norm", "rope_fusion", "experts")})
    return model, optimizer, groups, ids, info


def linear_attention_kernels(lm) -> dict | None:
    """Where a Gated DeltaNet layer's kernels come from, for classes that hold them per instance (AutoModel's)."""
    for module in lm.modules():
        rule = getattr(module, "chunk_gated_delta_rule", None)
        if callable(rule):
            conv = getattr(module, "causal_conv1d_fn", None)
            return {"chunk_gated_delta_rule": f"{rule.__module__}.{rule.__name__}",
                    "causal_conv1d_fn": None if conv is None else f"{conv.__module__}.{conv.__name__}"}
    return None  # transformers' class calls module-level functions: sft_throughput's recurrent_layers_path says


# -- the run -----------------------------------------------------------------------------------------------------


def first_padded_loss(model, samples, args, device) -> dict:
    """The loss on the first padded batch (``padded``'s first step), before any step has changed a weight."""
    from stitch.data.packing import collate_packs

    batch = collate_packs([[s] for s in samples[: args.baseline_batch]], 0, False).to(device)
    model.train()
    with torch.no_grad():
        loss, labels = model.loss(batch)
    return {"loss": float(loss), "labels": int(labels)}


def equal_loss(transformers_first: dict | None, automodel_first: dict | None, rtol: float) -> dict:
    if transformers_first is None or automodel_first is None:
        missing = "transformers" if transformers_first is None else "automodel"
        return {"skipped": f"the {missing} backend did not run", "agree": None}
    ref, got = transformers_first["loss"], automodel_first["loss"]
    rel = abs(got - ref) / abs(ref)
    return {"transformers_unpacked_loss": ref, "automodel_loss": got, "labels": [transformers_first["labels"],
            automodel_first["labels"]], "relative_diff": rel, "rtol": rtol,
            "agree": rel <= rtol and transformers_first["labels"] == automodel_first["labels"]}


def timed(mode: str, run, modes: dict, save) -> None:
    """``modes[mode] = run()`` under this script's mode name, an OOM recorded as the mode's error; then saved."""
    try:
        modes[mode] = {**run(), "mode": mode}
    except torch.OutOfMemoryError as exc:
        modes[mode] = {"mode": mode, "error": f"OOM: {str(exc)[:300]}"}
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log(f"{mode}: {json.dumps({k: v for k, v in modes[mode].items() if k not in ('step_s', 'warmup_step_s')})}")
    save()


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def ratios(modes: dict) -> dict:
    tps = {m: r.get("tokens_per_s") for m, r in modes.items() if r.get("tokens_per_s")}
    pairs = {"automodel_vs_packed": ("automodel", "packed"), "automodel_vs_stock": ("automodel", "stock"),
             "automodel_vs_padded": ("automodel", "padded"), "packed_vs_stock": ("packed", "stock")}
    return {name: round(tps[a] / tps[b], 3) for name, (a, b) in pairs.items() if a in tps and b in tps}


def table(result: dict) -> str:
    rows = ["| mode | rows x tokens | real tokens/step | tokens/s | step s mean | step s median | peak GiB |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for mode, r in result["modes"].items():
        if "tokens_per_s" not in r:
            rows.append(f"| {mode} | {r.get('skipped') or r.get('error')} | | | | | |")
            continue
        cfg = result["config"]
        shape = f"{r['rows']} x {r['budget']} packed" if "rows" in r else \
            f"{r['batch']} samples padded" if "batch" in r else f"{cfg['rows']} x {cfg['budget']} causal"
        rows.append(f"| {mode} | {shape} | {r['real_tokens_per_step']} | {r['tokens_per_s']:,.1f} | "
                    f"{r['step_s_mean']} | {r['step_s_median']} | {r['peak_gib']} |")
    guard = result["equal_loss"]
    rows.append("")
    rows.append("ratios (tokens/s): " + ", ".join(f"{k} {v}" for k, v in result["ratios"].items()))
    rows.append("equal-loss guard: " + (guard.get("skipped") or
                                        f"transformers {guard['transformers_unpacked_loss']:.5f} vs automodel "
                                        f"{guard['automodel_loss']:.5f}, relative {guard['relative_diff']:.2e} "
                                        f"(rtol {guard['rtol']}): {'agree' if guard['agree'] else 'DIFFER'}"))
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--budget", type=int, default=4096, help="tokens per pack (packed) and per stock row")
    ap.add_argument("--rows", type=int, default=1, help="packs per step")
    ap.add_argument("--baseline-batch", type=int, default=16, help="samples per padded step (padded, automodel)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=4, help="packed/stock; padded modes warm up on the timed batches")
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--text-min", type=int, default=30)
    ap.add_argument("--text-max", type=int, default=300)
    ap.add_argument("--grad-ckpt", action="store_true")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation of the stock mode")
    ap.add_argument("--loss-rtol", type=float, default=1e-2, help="equal-loss guard, relative (bf16)")
    ap.add_argument("--snapshot-root", default=None, help="where the temporary snapshot goes (default /dev/shm "
                                                          "when it has room, else /tmp)")
    ap.add_argument("--keep-snapshot", action="store_true")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--tag", default="", help="suffix for the result name")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run")
    args = ap.parse_args()
    if args.smoke:
        args.budget, args.steps, args.warmup, args.samples, args.baseline_batch = 512, 2, 1, 64, 4
    args.profile, args.profile_modes = 0, ""  # what sft_throughput's run_mode / run_stock read
    modes_wanted = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes_wanted) - set(MODES))
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; expected some of {list(MODES)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kernels = kernel_report()
    try:
        kernels["nemo_automodel"] = importlib.metadata.version("nemo_automodel")
    except importlib.metadata.PackageNotFoundError:
        kernels["nemo_automodel"] = None
    log(f"device {device}; kernels {kernels}")
    host = plugin_host()
    name = f"sft_{SHAPE}_automodel{args.tag}"
    result: dict = {"config": vars(args), "kernels": kernels, "shape": SHAPE, "models": {}, "modes": {},
                    "equal_loss": {"skipped": "not run yet", "agree": None}, "ratios": {}}

    def save() -> None:  # after every mode: a run cut short by its time limit keeps what it finished
        result["ratios"] = ratios(result["modes"])
        write_result(name, result, args.out)

    first: dict = {}
    # `timeout` sends SIGTERM: exit through the finally below, so a snapshot in /dev/shm (host memory) is removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    snapshot, result["snapshot"] = write_shape_snapshot(args, Path(args.snapshot_root) if args.snapshot_root else None)
    try:
        samples, pixels = transformers_modes(host, snapshot, args, device, modes_wanted, result, first, save)
        release()  # the transformers model is gone before AutoModel's loads: each mode's peak is its own
        if "automodel" in modes_wanted:
            automodel_mode(host, snapshot, args, device, samples, pixels, result, first, save)
            release()
    finally:
        if not args.keep_snapshot:
            shutil.rmtree(snapshot, ignore_errors=True)
    result["equal_loss"] = equal_loss(first.get("transformers"), first.get("automodel"), args.loss_rtol)
    save()
    log(table(result))
    failed = result["equal_loss"]["agree"] is False or any("error" in r for r in result["modes"].values())
    sys.exit(1 if failed else 0)


def transformers_modes(host, snapshot: Path, args, device, wanted: list[str], result: dict, first: dict, save):
    """``packed``, ``padded`` and ``stock`` on the transformers backend; returns the samples every mode uses."""
    model, optimizer, groups, ids, info = load_stitched(host, snapshot, "transformers", args, device)
    result["models"]["transformers"] = info
    result["stitch_as_shipped_mode"] = "packed" if info["supports_packing"] else "padded"
    log(f"transformers: {json.dumps(info)}")
    samples, pixels = make_samples(args.samples, info["vocab_size"], ids, args.text_min, args.text_max, 0, 1,
                                   args.smoke)
    first["transformers"] = first_padded_loss(model, samples, args, device)
    for mode in ("packed", "padded", "stock"):
        if mode not in wanted:
            continue
        if mode == "stock":
            timed(mode, lambda: run_stock(model, optimizer, groups, args, info, device), result["modes"], save)
        else:
            stitch_mode = "packed" if mode == "packed" else "cached_padded"
            timed(mode, lambda m=stitch_mode: run_mode(m, model, optimizer, groups, samples, pixels, args, ids, info,
                                                       device), result["modes"], save)
    return samples, pixels


def automodel_mode(host, snapshot: Path, args, device, samples, pixels, result: dict, first: dict, save) -> None:
    """``automodel``: sft_throughput's padded step on AutoModel's class; skipped, saying why, when the backend
    cannot import here."""
    from stitch.model.loading import BackendError

    try:
        model, optimizer, groups, ids, info = load_stitched(host, snapshot, "automodel", args, device)
    except BackendError as exc:
        log(f"automodel: skipped, NeMo AutoModel is not usable here: {exc}")
        result["modes"]["automodel"] = {"mode": "automodel", "skipped": str(exc)}
        save()
        return
    except Exception as exc:  # noqa: BLE001 - the result records why AutoModel's path failed; the rest is written
        result["modes"]["automodel"] = {"mode": "automodel", "error": f"{type(exc).__name__}: {exc}"[:2000],
                                        "traceback": traceback.format_exc()[-4000:]}
        log(f"automodel: failed to build: {result['modes']['automodel']['error'][:300]}")
        save()
        return
    result["models"]["automodel"] = info
    log(f"automodel: {json.dumps(info)}")
    first["automodel"] = first_padded_loss(model, samples, args, device)
    timed("automodel", lambda: run_mode("cached_padded", model, optimizer, groups, samples, pixels, args, ids, info,
                                        device), result["modes"], save)

if __name__ == "__main__":
    main()
