"""Preparing data, training stages and the whole chain (`stitch run`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import typer

from stitch.cli.app import app, console, print_table, wrapping_table
from stitch.config.recipe import Recipe, load_recipe
from stitch.host.host import get_host
from stitch.host.validate import validate_recipe
from stitch.stages.registry import STAGES

OVERRIDES_HELP = "Recipe overrides as key=value (e.g. stages.sft.steps=50)."


def _load(recipe: str, overrides: list[str] | None) -> Recipe:
    """The recipe (a registered name or a path) with command-line ``key=value`` overrides applied (and refused by
    field path when wrong)."""
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
    if stage not in STAGES:
        raise typer.BadParameter(f"unknown stage {stage!r}; expected one of {', '.join(STAGES)}")
    loaded = _load(recipe, overrides)
    validate_recipe(loaded, get_host())
    if stage not in loaded.stages:
        raise typer.BadParameter(f"recipe {loaded.name!r} has no stage {stage!r}; it has {sorted(loaded.stages)}")
    # torch and transformers take seconds that a refused recipe should not wait for
    from stitch.stages.distributed import launch_rank  # deferred: past the recipe's checks
    from stitch.stages.loop import run_stage  # deferred: past the recipe's checks

    summary = run_stage(loaded, stage, out or Path("runs") / loaded.name, registry=get_host(), resume=resume,
                        max_steps=max_steps)
    if launch_rank() == 0:
        _print_summary(stage, summary)


def _print_summary(stage: str, summary: dict[str, Any]) -> None:
    table = wrapping_table(f"{stage} summary", "field", "value")
    for key, value in summary.items():
        if key != "completion_table":
            table.add_row(key, json.dumps(value) if isinstance(value, dict | list) else str(value))
    print_table(table)
    _print_completions(summary.get("completion_table"))


def _print_completions(rows: list[dict[str, Any]] | None) -> None:
    """GRPO's last logged completions: what the policy sampled and how each scored (all: completions.jsonl)."""
    if not rows:
        return
    table = wrapping_table(f"grpo completions, step {rows[0]['step']}", "prompt", "rewards", "advantage", "tokens",
                           "completion")
    for row in rows:
        capped = " (hit max_new_tokens)" if row["hit_max_new_tokens"] else ""
        table.add_row(row["prompt_id"], json.dumps(row["rewards"]), f"{row['advantage']:+.2f}",
                      f"{row['tokens']}{capped}", repr(row["completion"]))
    print_table(table)


def prepared_notes(report: dict[str, Any]) -> str:
    """Rows per dataset and the media items shared between rows (encoded once), for a table's cell."""
    rows = "; ".join(f"{name} {sum(info['rows'].values())} rows" for name, info in report.get("datasets", {}).items())
    return f"{rows}; {report.get('items_encoded', 0)} items encoded, {report.get('items_shared', 0)} shared"


def mixture_notes(mixture: dict[str, Any] | None) -> str:
    """A stage's realised data mixture (``{partition: {weight, drawn, share}}``), when it draws from several."""
    if not mixture or len(mixture) < 2:
        return ""
    return "; drew " + ", ".join(f"{name} {m['share']:.0%} (weight {m['weight']:.0%})" for name, m in mixture.items())


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
    if "=" in recipe and not Path(recipe).exists():  # `stitch run key=value ...`: overrides of the default recipe
        overrides, recipe = [recipe, *(overrides or [])], "demo"
    loaded = _load(recipe, overrides)
    out = out or Path("runs") / loaded.name
    validate_recipe(loaded, get_host())  # every stage's options, before any data or weights are touched
    from stitch.stages.chain import DEFAULT_STAGES, run_chain  # deferred: past the recipe's checks

    summary = run_chain(loaded, out, registry=get_host(), stages=DEFAULT_STAGES + (("dpo",) if dpo else ()),
                        resume=not fresh)
    table = wrapping_table(f"stitch run {loaded.name} -> {out}", "stage", "seconds", "eval accuracy", "notes")
    for stage, info in summary["stages"].items():
        notes = ""
        if stage == "grpo":
            notes = f"reward {info['reward_start']:.2f} -> {info['reward_end']:.2f}"
            if info.get("flat_reward_steps_max"):
                notes += f"; all groups scored alike for {info['flat_reward_steps_max']} steps in a row"
        elif "loss_first" in info and info["loss_first"] is not None:
            notes = f"loss {info['loss_first']:.3f} -> {info['loss_last']:.3f}"
        elif stage == "prepare":
            notes = prepared_notes(info)
        notes += mixture_notes(info.get("data"))
        acc = info.get("eval_accuracy")
        table.add_row(stage, str(info.get("seconds", "")), "-" if acc is None else f"{acc:.1%}", notes)
    print_table(table)
    _print_completions(summary["stages"].get("grpo", {}).get("completion_table"))
    evaluation = summary.get("evaluation")
    if evaluation:
        control = evaluation.get("zeroed_features_accuracy")
        baseline = evaluation["majority_baseline"]
        console.print(
            f"{evaluation['stage']} checkpoint on {evaluation['rows']} rows of {evaluation['partition']!r} (scored "
            f"by {evaluation.get('scorer', evaluation['task'])}): accuracy {evaluation['accuracy']:.1%}"
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
    loaded = _load(recipe, overrides)
    from stitch.data.prepare import describe_skips  # deferred: past the recipe's checks
    from stitch.data.prepare_report import REPORT_NAME  # deferred: past the recipe's checks
    from stitch.model.binding import ModelBinding  # deferred: past the recipe's checks
    from stitch.stages.chain import prepare_data  # deferred: past the recipe's checks

    out = out or Path("runs") / loaded.name / "data"
    if device == "auto":
        import torch  # deferred: stitch --help skips torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    binding = ModelBinding.for_recipe(loaded, get_host(), device="cpu")  # the tokenizer only
    report = prepare_data(loaded, binding, out, device=device)  # a refusal leaves through the CLI's error boundary
    table = wrapping_table(f"prepare {loaded.name} -> {out}", "field", "value")
    table.add_row("rows", ", ".join(f"{k}={v}" for k, v in report.rows.items()))
    if len(report.datasets) > 1 or report.items_shared:
        table.add_row("datasets", prepared_notes(dataclasses.asdict(report)))
    table.add_row("scanned / skipped", f"{report.rows_scanned} / {len(report.skipped)}")
    table.add_row("shards encoded / reused", f"{report.shards_encoded} / {report.shards_reused}")
    table.add_row("peak transient", f"{report.peak_transient_bytes / 2**20:.2f} MiB (budget {loaded.data.budgets.transient_mib})")
    table.add_row("retained", f"{report.retained_bytes / 2**20:.2f} MiB (budget {loaded.data.budgets.retained_mib})")
    table.add_row("retained per row", f"{report.retained_bytes_per_row:,.0f} B (features {report.payload_bytes_per_row:,.0f} B)")
    table.add_row("seconds", f"{report.seconds:.1f}")
    print_table(table)
    if report.skipped:
        console.print(f"[yellow]skipped by reason:[/yellow] {describe_skips(report.skipped)}; every row and its "
                      f"reason: {Path(report.out_dir) / REPORT_NAME}", highlight=False)


