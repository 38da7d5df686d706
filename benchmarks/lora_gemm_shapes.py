"""Every LoRA product of a packed SFT step, one projection shape at a time: where the skinny GEMMs go.

Round 9's profile of Qwen3.5-4B's packed step (BENCHMARKS.md §0h) found two cuBLAS kernels with 32-wide tiles
taking 37 ms of a 198 ms step (61 calls each, ~0.3 ms a call). The rank-16 products of ``LoRAProduct`` and the
32-wide ``in_proj_a`` / ``in_proj_b`` are the candidates. This script times, for each LoRA target of a shape
(found on the real config, built on the meta device, so nothing is allocated), at the step's token count:

- ``LoRAProduct`` forward + backward as shipped (``stitch.kernels.precision``), op by op: its eight GEMMs;
- the same eight products with the skinny ones' operands swapped (``(a @ x.T).T`` for ``x @ a.T`` ...): the same
  numbers, another cuBLAS kernel;
- the rank padded to 64 (zeros): if the padded product takes as long as rank 16, the kernel, not the work, is slow;
- stock peft (``peft.tuners.lora.Linear``, its adapters in fp32, as peft keeps them) forward + backward,
  and ``LoRAProduct`` as one autograd call;
- for a Qwen3.5 shape, the fused Gated DeltaNet's four input projections forward + backward as four
  ``LoRAProduct`` nodes and as the one ``SharedInputLoRA`` node the step runs (``shared_input_projections``).

It prints a table per shape and the per-step sums (ms per call x calls per step) with ratios, and writes
``lora_gemm_shapes<tag>.json``. Nothing here changes the shipped path.

    PYTHONPATH=. python3 benchmarks/lora_gemm_shapes.py --shapes qwen35_4b,dense4b --out $OUT      # H200, ~1 min
    PYTHONPATH=. python benchmarks/lora_gemm_shapes.py --smoke --out /tmp/bench                    # CPU, seconds
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import log, sync, write_result  # noqa: E402
from benchmarks.sft_throughput import build_lm, plugin_host  # noqa: E402

SCALING = 2.0  # alpha 32 / r 16, as sft_throughput's LoRA


def lora_targets(shape: str, smoke: bool) -> list[dict]:
    """One entry per distinct (kind, in, out) LoRA target of ``shape``'s model: its count in the model."""
    cls, cfg, spec_name = build_lm(shape, smoke)
    spec = plugin_host().get("models", spec_name)
    with torch.device("meta"):
        lm = cls._from_config(cfg)
    targets = list(spec.lora_target_modules)
    counts: collections.Counter = collections.Counter()
    for name, module in lm.named_modules():
        kind = next((t for t in targets if name == t or name.endswith("." + t)), None)
        if kind is not None and isinstance(module, torch.nn.Linear):
            counts[(kind, module.in_features, module.out_features)] += 1
    return [{"kind": k, "in": i, "out": o, "count": n} for (k, i, o), n in sorted(counts.items())]


def timed(fn, reps: int) -> float:
    """Milliseconds per call of ``fn`` (CUDA events on a GPU, the wall clock on the CPU), after 3 warm-up calls."""
    for _ in range(3):
        fn()
    if torch.cuda.is_available():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        sync()
        return start.elapsed_time(end) / reps
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) * 1000 / reps


def products(tokens: int, d_in: int, d_out: int, rank: int, device, dtype) -> dict:
    """LoRAProduct's eight GEMMs on random operands, each as shipped and with the skinny operands swapped."""
    x = torch.randn(tokens, d_in, device=device, dtype=dtype)
    w = torch.randn(d_out, d_in, device=device, dtype=dtype)
    a = torch.randn(rank, d_in, device=device, dtype=dtype)
    b = torch.randn(d_out, rank, device=device, dtype=dtype)
    g = torch.randn(tokens, d_out, device=device, dtype=dtype)
    low = x @ a.t()
    g_low = g @ b
    out = torch.empty(tokens, d_out, device=device, dtype=dtype)
    gx = torch.empty(tokens, d_in, device=device, dtype=dtype)
    shipped = {
        "fwd x@A^T": lambda: x @ a.t(),
        "fwd x@W^T": lambda: x @ w.t(),
        "fwd out+=low@B^T": lambda: out.addmm_(low, b.t(), alpha=SCALING),
        "bwd g@B": lambda: g @ b,
        "bwd g@W": lambda: g @ w,
        "bwd gx+=g_low@A": lambda: gx.addmm_(g_low, a),
        "bwd grad_A=g_low^T@x": lambda: g_low.t() @ x,
        "bwd grad_B=g^T@low": lambda: g.t() @ low,
    }
    swapped = {  # the same products, the other operand order (a transposed result): only the skinny ones differ
        "fwd x@A^T": lambda: (a @ x.t()).t(),
        "bwd g@B": lambda: (b.t() @ g.t()).t(),
        "bwd grad_A=g_low^T@x": lambda: (x.t() @ g_low).t(),
        "bwd grad_B=g^T@low": lambda: (low.t() @ g).t(),
    }
    return {"shipped": shipped, "swapped": swapped}


def module_step(tokens: int, d_in: int, d_out: int, rank: int, device, dtype) -> dict:
    """One projection's forward + backward as the step runs it: ``LoRAProduct`` (shipped) and stock peft."""
    from peft import LoraConfig, inject_adapter_in_model

    from stitch.kernels.precision import LoRAProduct

    base = torch.nn.Linear(d_in, d_out, bias=False, device=device, dtype=dtype).requires_grad_(False)
    lora_a = torch.nn.Parameter(torch.randn(rank, d_in, device=device) * 0.01)  # fp32 masters, as shipped
    lora_b = torch.nn.Parameter(torch.randn(d_out, rank, device=device) * 0.01)
    x = torch.randn(tokens, d_in, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(tokens, d_out, device=device, dtype=dtype)

    def shipped():
        LoRAProduct.apply(x, base.weight, None, lora_a, lora_b, SCALING).backward(g)

    holder = torch.nn.ModuleDict({"proj": base})
    config = LoraConfig(r=rank, lora_alpha=int(SCALING * rank), lora_dropout=0.0, target_modules=["proj"])
    peft = inject_adapter_in_model(config, holder)["proj"].to(device)  # adapters fp32, as peft creates them

    def stock():
        peft(x).backward(g)

    return {"shipped": shipped, "stock peft": stock}


GDN_INPUTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")  # what the fused Gated DeltaNet groups


def gdn_inputs(targets: list[dict], tokens: int, rank: int, device, dtype) -> tuple[int, dict]:
    """The fused Gated DeltaNet's four input projections, forward + backward, as four ``LoRAProduct`` nodes and as
    one ``SharedInputLoRA`` node (``shared_input_projections``, shipped): ``(layers, {name: fn})``, ``(0, {})`` for a
    shape without them."""
    from peft import LoraConfig, get_peft_model

    from stitch.kernels.precision import lora_in_half_compute, shared_input_projections

    widths = {t["kind"]: (t["in"], t["out"], t["count"]) for t in targets if t["kind"] in GDN_INPUTS}
    if len(widths) < len(GDN_INPUTS):
        return 0, {}
    holder = torch.nn.Module()
    for kind in GDN_INPUTS:
        d_in, d_out, _ = widths[kind]
        holder.add_module(kind, torch.nn.Linear(d_in, d_out, bias=False, device=device, dtype=dtype))
    holder.requires_grad_(False)
    model = get_peft_model(holder, LoraConfig(r=rank, lora_alpha=int(SCALING * rank), target_modules=list(GDN_INPUTS)))
    lora_in_half_compute(model)
    modules = [getattr(model.base_model.model, kind) for kind in GDN_INPUTS]
    x = torch.randn(tokens, widths["in_proj_qkv"][0], device=device, dtype=dtype, requires_grad=True)
    grads = [torch.randn(tokens, widths[kind][1], device=device, dtype=dtype) for kind in GDN_INPUTS]

    def step(outs):
        torch.autograd.backward(outs, grads)

    return widths["in_proj_qkv"][2], {"four nodes": lambda: step([m(x) for m in modules]),
                                      "one node (shipped)": lambda: step(shared_input_projections(x, modules))}


def run_shape(shape: str, args, device, dtype) -> dict:
    rows = []
    totals: collections.Counter = collections.Counter()
    for target in lora_targets(shape, args.smoke):
        d_in, d_out, n = target["in"], target["out"], target["count"]
        ops = products(args.tokens, d_in, d_out, args.rank, device, dtype)
        padded = products(args.tokens, d_in, d_out, 64, device, dtype)["shipped"] if args.rank < 64 else {}
        row = {**target, "ms": {}}
        for op, fn in ops["shipped"].items():
            entry = {"shipped": timed(fn, args.reps)}
            if op in ops["swapped"]:
                entry["swapped"] = timed(ops["swapped"][op], args.reps)
            if op in padded and op not in ("fwd x@W^T", "bwd g@W"):
                entry["rank 64"] = timed(padded[op], args.reps)
            row["ms"][op] = {k: round(v, 4) for k, v in entry.items()}
            totals["eight GEMMs as shipped"] += n * entry["shipped"]
            totals["eight GEMMs, faster order of each"] += n * min(entry["shipped"], entry.get("swapped", 1e9))
        for name, fn in module_step(args.tokens, d_in, d_out, args.rank, device, dtype).items():
            ms = timed(fn, args.reps)
            row["ms"][f"module fwd+bwd, {name}"] = round(ms, 4)
            totals[f"module fwd+bwd, {name}"] += n * ms
        rows.append(row)
        log(f"{shape} {target['kind']} {d_in}->{d_out} x{n}: "
            + ", ".join(f"{op} {v}" for op, v in row["ms"].items()))
    layers, grouped = gdn_inputs(rows, args.tokens, args.rank, device, dtype)
    for name, fn in grouped.items():
        totals[f"Gated DeltaNet inputs fwd+bwd, {name}"] = layers * timed(fn, args.reps)
    per_step = {k: round(v, 2) for k, v in totals.items()}
    shipped = per_step["eight GEMMs as shipped"]
    ratios = {
        "shipped / faster order (eight GEMMs)": round(shipped / max(per_step["eight GEMMs, faster order of each"],
                                                                     1e-9), 3),
        "stock peft / shipped (module fwd+bwd)": round(per_step["module fwd+bwd, stock peft"]
                                                       / max(per_step["module fwd+bwd, shipped"], 1e-9), 3),
    }
    if grouped:
        ratios["four nodes / one node (Gated DeltaNet inputs)"] = round(
            per_step["Gated DeltaNet inputs fwd+bwd, four nodes"]
            / max(per_step["Gated DeltaNet inputs fwd+bwd, one node (shipped)"], 1e-9), 3)
    log(f"{shape} per step, ms: {per_step}; ratios {ratios}")
    return {"targets": rows, "ms_per_step": per_step, "ratios": ratios}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen35_4b,dense4b")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="tiny widths, few tokens, on the CPU")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.tokens, args.reps = min(args.tokens, 256), min(args.reps, 3)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results = {shape: run_shape(shape, args, device, dtype) for shape in args.shapes.split(",")}
    path = write_result(f"lora_gemm_shapes{args.tag}", {"config": vars(args), "shapes": results}, args.out)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
