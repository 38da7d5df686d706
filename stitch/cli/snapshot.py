"""`stitch snapshot`: write a model's random-init snapshot in its published checkpoint layout, for offline use."""

from __future__ import annotations

import tempfile
from pathlib import Path

import typer

from stitch.cli.app import app, console
from stitch.host.host import get_host

DTYPES = ("bfloat16", "float16", "float32")


@app.command("snapshot")
def snapshot(
    model: str = typer.Argument(..., help="A registered model with a published layout (see `stitch models`)."),
    out: Path = typer.Option(None, "--out", help="Directory to write (created; must not hold a snapshot yet)."),
    layers: int = typer.Option(None, "--layers", help="Keep this many layers (every layer type kept), for tests."),
    width: int = typer.Option(None, "--width", help="Narrow to this hidden size (heads, experts shrink too)."),
    dtype: str = typer.Option("bfloat16", "--dtype", help=f"Weight dtype: {', '.join(DTYPES)}."),
    shard_gib: float = typer.Option(5.0, "--shard-gib", help="Largest shard file, GiB."),
    plan: bool = typer.Option(False, "--plan", help="Only print the shards and bytes it would write."),
    spill_dir: Path = typer.Option(None, "--spill-dir", help="Where shards go once --disk-budget-gib is reached "
                                                              "(e.g. /dev/shm); linked from --out."),
    disk_budget_gib: float = typer.Option(None, "--disk-budget-gib", help="Shard bytes to write under --out."),
    init_device: str = typer.Option("cpu", "--init-device", help="Where weights are initialised: cpu, or cuda "
                                                                  "(a 35B write is then disk-bound, not RNG-bound)."),
) -> None:
    """Write a model's published layout with seeded random weights, so a recipe trains offline.

    config.json, tokenizer and weights go under the published key names, shard by shard (the host never holds the
    whole model); `model: {name: MODEL, snapshot: OUT}` in a recipe then trains on them."""
    import torch  # deferred: stitch --help skips torch

    from stitch.model.snapshots import write_model_snapshot  # deferred: stitch --help skips torch

    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if init_device not in ("cpu", "cuda"):
        raise ValueError(f"--init-device {init_device!r}: expected cpu or cuda")
    if init_device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--init-device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    if out is None and not plan:
        raise ValueError("--out DIR is required (or --plan to print the layout without writing)")
    spec = get_host().get("models", model)
    options = {"layers": layers, "width": width, "dtype": getattr(torch, dtype), "dry_run": plan,
               "max_shard_bytes": int(shard_gib * 2**30), "progress": lambda line: console.print(line, highlight=False),
               "spill_dir": spill_dir,
               "disk_budget_bytes": None if disk_budget_gib is None else int(disk_budget_gib * 2**30),
               "init_device": init_device}
    if plan:
        with tempfile.TemporaryDirectory(prefix="stitch-snapshot-plan-") as tmp:  # the tokenizer sets the ids
            write_model_snapshot(spec, Path(tmp), **options)
        return
    write_model_snapshot(spec, out, **options)
    console.print(f"wrote {model} to {out}; train it offline with `model: {{name: {model}, snapshot: {out}}}`",
                  highlight=False)
