"""Shared helpers for the GPU benchmarks: machine info, timing, result files.

Nothing here asserts on speed: the scripts measure and write JSON; BENCHMARKS.md reads the numbers.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

# NVIDIA H200 SXM (= H100 SXM arithmetic) dense bf16 tensor-core peak, datasheet value.
H200_BF16_DENSE_PEAK = 989e12
RESULTS_DIR = Path(__file__).resolve().parent / "results"


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


def profile_once(fn, top: int = 25) -> dict:
    """One call of ``fn`` under torch.profiler: device milliseconds in all and by kernel (top ``top``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [(e.key, e.self_device_time_total / 1000, e.count) for e in prof.key_averages()
               if e.self_device_time_total > 0]
    kernels.sort(key=lambda k: -k[1])
    return {"device_ms": round(sum(k[1] for k in kernels), 2),
            "top_kernels_ms": [[k[:110], round(ms, 3), n] for k, ms, n in kernels[:top]]}


def write_result(name: str, payload: dict[str, Any], out_dir: str | Path | None = None) -> Path:
    """Write ``payload`` (plus machine info and the command line) to ``<out_dir>/<name>.json``."""
    out = Path(out_dir) if out_dir else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    doc = {
        "name": name,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(),
        **payload,
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}", flush=True)
    return path


def log(*args: Any) -> None:
    print(*args, flush=True)
