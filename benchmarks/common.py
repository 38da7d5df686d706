"""Shared by every suite: machine facts, FLOP and MFU arithmetic, the result files and the RESULTS.md table.

Nothing here asserts on speed: the suites measure and write JSON; RESULTS.md and BENCHMARKS.md read the numbers.
"""

from __future__ import annotations

import collections
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

# NVIDIA H200 SXM (= H100 SXM arithmetic) dense bf16 tensor-core peak, datasheet value.
H200_BF16_DENSE_PEAK = 989e12
RESULTS_DIR = Path(__file__).resolve().parent / "results"  # one SUITE.json per suite, nothing else
RESULTS_TABLE = RESULTS_DIR.parent / "RESULTS.md"  # the generated table of current figures


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def machine_info() -> dict[str, Any]:
    """GPU, library versions and host facts, recorded in every result."""
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    for pkg in (
        "transformers",
        "peft",
        "triton",
        "flash-linear-attention",
        "fla-core",
        "mamba-ssm",
        "causal-conv1d",
        "liger-kernel",
        "pillow",
        "safetensors",
    ):
        info[pkg] = _version(pkg)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_count"] = torch.cuda.device_count()
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["sm_count"] = props.multi_processor_count
        info["capability"] = f"{props.major}.{props.minor}"
    else:
        info["gpu"] = None
    return info


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def now() -> float:
    sync()
    return time.perf_counter()


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float | None:
    if not torch.cuda.is_available():
        return None
    return round(torch.cuda.max_memory_allocated() / 2**30, 2)


def log(*args: Any) -> None:
    print(*args, flush=True)


# -- FLOPs and MFU ------------------------------------------------------------------------------------------------


def matmul_params(lm: torch.nn.Module) -> tuple[int, int]:
    """(frozen, trainable) matmul parameters of ``lm``: every weight but the input embedding table, a tied LM head
    counted once (it is a GEMM even when it shares the table's storage)."""
    emb = lm.get_input_embeddings().weight
    head = lm.get_output_embeddings().weight
    frozen = sum(p.numel() for p in lm.parameters() if not p.requires_grad) - emb.numel()
    if head.data_ptr() == emb.data_ptr():
        frozen += head.numel()
    trainable = sum(p.numel() for p in lm.parameters() if p.requires_grad)
    return frozen, trainable


def flops_per_token(frozen: int, trainable: int) -> dict[str, int]:
    """Training FLOPs per token, two ways. ``6n``: the usual 6 x all matmul parameters. ``lora``: what runs; a frozen
    weight has no weight-gradient GEMM (2 forward + 2 input-gradient), a trainable one has all three (6)."""
    return {"6n": 6 * (frozen + trainable), "lora": 4 * frozen + 6 * trainable}


def mfu(flops_per_tok: dict[str, int], tokens_per_s: float) -> dict[str, float | None]:
    """Model FLOPs utilisation against the GPU's dense bf16 peak (None off a GPU: no peak to divide by)."""
    if not torch.cuda.is_available():
        return {f"mfu_{k}": None for k in flops_per_tok}
    return {f"mfu_{k}": round(v * tokens_per_s / H200_BF16_DENSE_PEAK, 4) for k, v in flops_per_tok.items()}


# -- results ------------------------------------------------------------------------------------------------------


def commit() -> str | None:
    """The measured commit: ``STITCH_BENCH_COMMIT`` when set (the caller's ``git rev-parse HEAD``: a copy of the
    tree on another machine may carry stale git metadata), else this checkout's HEAD, ``+dirty`` with local edits."""
    given = os.environ.get("STITCH_BENCH_COMMIT", "").strip()
    if given:
        return given
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, cwd=here)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, cwd=here).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head.stdout.strip() + ("+dirty" if dirty else "")) if head.returncode == 0 else None


def short_commit(commit: str | None) -> str:
    """A commit as the table shows it: 7 hex digits, with ``+dirty`` kept."""
    if not commit:
        return "?"
    sha, plus, rest = commit.partition("+")
    return sha[:7] + plus + rest


def write_result(suite: str, payload: dict[str, Any], out_dir: Path) -> Path:
    """``out_dir/SUITE.json`` (overwritten): the payload with the machine, versions, commit, date and command."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{suite}.json"
    doc = {"suite": suite, "command": " ".join([Path(sys.executable).name, *sys.argv]), "commit": commit(),
           "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine_info(), **payload}
    partial = path.with_suffix(".json.partial")  # a suite killed mid-write leaves the last whole file
    partial.write_text(json.dumps(doc, indent=2) + "\n")
    partial.replace(path)
    log(f"wrote {path}")
    return path


def write_suite(args: Any, payload: dict[str, Any]) -> Path:
    """``args.out/SUITE.json`` for a suite's parsed options (recorded as its config) and its payload, and the
    table regenerated: what bench.py writes at the end, and what a long suite writes as it goes."""
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    path = write_result(args.suite, {"config": config, **payload}, args.out)
    write_table(args.out)
    return path


def write_table(out_dir: Path) -> Path:
    """The table of current figures: one row per suite and shape, the headline figures of every SUITE.json in
    ``out_dir``. It goes to ``benchmarks/RESULTS.md`` when ``out_dir`` is benchmarks/results (which holds only the
    JSONs), else beside the JSONs in ``out_dir`` (a GPU call's output folder, copied back by hand)."""
    target = RESULTS_TABLE if out_dir.resolve() == RESULTS_DIR.resolve() else out_dir / "RESULTS.md"
    lines = ["# Current figures", "", "Generated by `benchmarks/bench.py` from `benchmarks/results/*.json`; "
             "BENCHMARKS.md says what each figure means.", "",
             "| suite | shape | figures | GPU | commit | date |", "| --- | --- | --- | --- | --- | --- |"]
    for path in sorted(out_dir.glob("*.json")):
        doc = json.loads(path.read_text())
        for row in doc.get("rows", []):  # a row measured by an earlier call carries its own where and when
            figures = ", ".join(f"{k} {v}" for k, v in row["figures"].items())
            where = row.get("measured") or {"gpu": doc["machine"].get("gpu"), "commit": doc.get("commit"),
                                             "utc": doc["utc"]}
            lines.append(f"| {doc['suite']} | {row['shape']} | {figures} | {where['gpu'] or 'CPU'} "
                         f"| {short_commit(where['commit'])} | {where['utc'][:10]} |")
    target.write_text("\n".join(lines) + "\n")
    log(f"wrote {target}")
    return target


def _frame_site(frames: list[dict[str, Any]], depth: int = 6) -> str:
    """An allocation's call site: its innermost frames in stitch, its plugins and the libraries they call."""
    keep = [f for f in frames if any(k in f["filename"] for k in ("stitch", "/fla/", "transformers/", "peft/", "liger"))]
    return " <- ".join(f"{f['filename'].split('site-packages/')[-1]}:{f['line']}:{f['name']}" for f in keep[:depth])


def record_memory_at_oom(path: Path) -> None:
    """Record the CUDA allocator's history from now on; at the process's first out-of-memory, write to ``path`` the
    live memory grouped by allocation site, then the reserved memory by pool (CUDA graph pools apart)."""
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    written: list[bool] = []

    def observer(device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        if written:
            return
        written.append(True)
        sites: collections.Counter[str] = collections.Counter()
        pools: collections.Counter[str] = collections.Counter()
        for segment in torch.cuda.memory._snapshot()["segments"]:
            pools[str(segment.get("segment_pool_id"))] += segment["total_size"]
            for block in segment["blocks"]:
                if block["state"] == "active_allocated":
                    sites[_frame_site(block.get("frames", []))] += block["size"]
        lines = [f"live {sum(sites.values()) / 2**30:.2f} GiB by allocation site"]
        lines += [f"{v / 2**30:8.2f} GiB  {k}" for k, v in sites.most_common(40)]
        lines += ["reserved by pool"]
        lines += [f"{v / 2**30:8.2f} GiB  pool {k}" for k, v in pools.most_common(20)]
        path.write_text("\n".join(lines) + "\n")

    torch._C._cuda_attach_out_of_memory_observer(observer)
