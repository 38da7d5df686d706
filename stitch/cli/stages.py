"""Preparing data, training stages and the whole chain (`stitch run`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from stitch.cli.app import app, console
from stitch.config.recipe import Recipe
from stitch.host.host import get_host
from stitch.stages.registry import STAGES

OVERRIDES_HELP = "Recipe overrides as key=value (e.g. stages.sft.steps=50)."


def _load(recipe: str, overrides: list[str] | None) -> Recipe:
    """The recipe (a registered name or a path) with command-line ``key=value`` overrides applied (and refused by
    field path when wrong)."""
    from stitch.config.recipe import load_recipe

    return load_recipe(recipe, get_host(), overrides=overrides or ())


@app.command()
def train(
    stage: str = typer.Argument(..., help=f"One of: {', '.join(STAGES)}"),
    overrides: list[str] = typer.Argument(None, help=OVERRIDES_HELP),
    recipe: str = typer.Option(..., "--recipe", help="A registered recipe name or a YAML path."),
    out: Path = typer.Option(None, "--out", help="Run directory (default runs/<recipe name>)."),
    resume: bool = typer.Option(False, "--resume", help="Continue exactly from checkpoints/LATEST."),
    max_steps: int = typer.Option(None, "--max-steps", help="Stop after this many steps (for smoke runs)."),
) -> None:
    """Run one post-training stage of a recipe; prepared data is read from OUT/data."""
    from stitch.host.validate import validate_recipe
    from stitch.stages.distributed import launch_rank
    from stitch.stages.loop import run_stage

    if stage not in STAGES:
        raise typer.BadParameter(f"unknown stage {stage!r}; expected one of {', '.join(STAGES)}")
    loaded = _load(recipe, overrides)
    validate_recipe(loaded, get_host())
    if stage not in loaded.stages:
        raise typer.BadParameter(f"recipe {loaded.name!r} has no stage {stage!r}; it has {sorted(loaded.stages)}")
    summary = run_stage(loaded, stage, out or Path("runs") / loaded.name, registry=get_host(), resume=resume,
                        max_steps=max_steps)
    if launch_rank() == 0:
        _print_summary(stage, summary)


def _print_summary(stage: str, summary: dict[str, Any]) -> None:
    table = Table(title=f"{stage} summary")
    table.add_column("field")
    table.add_column("value")
    for key, value in summary.items():
        table.add_row(key, json.dumps(value) if isinstance(value, dict | list) else str(value))
    console.print(table)


@app.command()
def run(
    recipe: str = typer.Argument("demo", help="A registered recipe name or a YAML path (omit it to run `demo`, "
                                              "overrides included: `stitch run stages.sft.steps=10`)."),
    overrides: list[str] = typer.Argument(None, help=OVERRIDES_HELP),
    out: Path = typer.Option(None, "--out", help="Run directory (default runs/<recipe name>)."),
    fresh: bool = typer.Option(False, "--fresh", help="Re-run stages whose summary already exists."),
    dpo: bool = typer.Option(False, "--dpo", help="Also run the DPO stage after GRPO."),
) -> None:
    """The main job: prepare -> alignment -> SFT -> GRPO -> evaluation -> answers to a few held-out rows."""
    from stitch.host.validate import validate_recipe
    from stitch.stages.chain import DEFAULT_STAGES, run_chain

    if "=" in recipe and not Path(recipe).exists():  # `stitch run key=value ...`: overrides of the default recipe
        overrides, recipe = [recipe, *(overrides or [])], "demo"
    loaded = _load(recipe, overrides)
    out = out or Path("runs") / loaded.name
    validate_recipe(loaded, get_host())  # every stage's options, before any data or weights are touched
    summary = run_chain(loaded, out, registry=get_host(), stages=DEFAULT_STAGES + (("dpo",) if dpo else ()),
                        resume=not fresh)
    table = Table(title=f"stitch run {loaded.name} -> {out}")
    for col in ("stage", "seconds", "eval accuracy", "notes"):
        table.add_column(col)
    for stage, info in summary["stages"].items():
        notes = ""
        if stage == "grpo":
            notes = f"reward {info['reward_start']:.2f} -> {info['reward_end']:.2f}"
        elif "loss_first" in info and info["loss_first"] is not None:
            notes = f"loss {info['loss_first']:.3f} -> {info['loss_last']:.3f}"
        acc = info.get("eval_accuracy")
        table.add_row(stage, str(info.get("seconds", "")), "-" if acc is None else f"{acc:.1%}", notes)
    console.print(table)
    evaluation = summary.get("evaluation")
    if evaluation:
        control = evaluation.get("zeroed_features_accuracy")
        baseline = evaluation["majority_baseline"]
        console.print(
            f"{evaluation['stage']} checkpoint on {evaluation['rows']} rows of {evaluation['partition']!r} (task "
            f"{evaluation['task']}): accuracy {evaluation['accuracy']:.1%}"
            + ("" if control is None else f", zeroed features {control:.1%}")
            + f", majority answer {baseline['answer']!r} {baseline['accuracy']:.1%}", highlight=False)
    inference = summary.get("inference") or {}
    for row in inference.get("rows", []):
        console.print(f"{row['id']}: {row['question']!r} -> {row['answer']!r} (expected {row['expected']!r}, "
                      f"score {row['score']:.2f})", highlight=False)
    console.print(f"summary: {out / 'summary.json'}; plots: {', '.join(summary['plots'])}", highlight=False)


@app.command()
def prepare(
    overrides: list[str] = typer.Argument(None, help=OVERRIDES_HELP),
    recipe: str = typer.Option(..., "--recipe", help="A registered recipe name or a YAML path."),
    out: Path = typer.Option(None, "--out", help="Output directory (default runs/<recipe name>/data)."),
    device: str = typer.Option("auto", "--device", help="Where the encoder runs (auto: cuda when there is one; "
                                                        "cpu, cuda, cuda:1...)."),
) -> None:
    """Stream the recipe's dataset, encode each row once, write feature-cache/ + manifest.jsonl."""
    from stitch.data.prepare import REPORT_NAME, describe_skips
    from stitch.model.binding import ModelBinding
    from stitch.stages.chain import prepare_data

    loaded = _load(recipe, overrides)
    out = out or Path("runs") / loaded.name / "data"
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    binding = ModelBinding.for_recipe(loaded, get_host(), device="cpu")  # the tokenizer only
    report = prepare_data(loaded, binding, out, device=device)  # a refusal leaves through the CLI's error boundary
    table = Table(title=f"prepare {loaded.name} -> {out}")
    table.add_column("field")
    table.add_column("value")
    table.add_row("rows", ", ".join(f"{k}={v}" for k, v in report.rows.items()))
    table.add_row("scanned / skipped", f"{report.rows_scanned} / {len(report.skipped)}")
    table.add_row("shards encoded / reused", f"{report.shards_encoded} / {report.shards_reused}")
    table.add_row("peak transient", f"{report.peak_transient_bytes / 2**20:.2f} MiB (budget {loaded.data.budgets.transient_mib})")
    table.add_row("retained", f"{report.retained_bytes / 2**20:.2f} MiB (budget {loaded.data.budgets.retained_mib})")
    table.add_row("retained per row", f"{report.retained_bytes_per_row:,.0f} B (features {report.payload_bytes_per_row:,.0f} B)")
    table.add_row("seconds", f"{report.seconds:.1f}")
    console.print(table)
    if report.skipped:
        console.print(f"[yellow]skipped by reason:[/yellow] {describe_skips(report.skipped)}; every row and its "
                      f"reason: {Path(report.out_dir) / REPORT_NAME}", highlight=False)


