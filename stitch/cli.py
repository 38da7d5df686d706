"""The ``stitch`` command line: registry views, plugin scaffolding, and the stages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from stitch.plugins import KINDS, get_host

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console()


def _print_failures() -> None:
    for failure in get_host().failures:
        console.print(
            f"[red]plugin {failure.distribution or failure.name!r} failed to load:[/red] {failure.error}",
            highlight=False,
        )


@app.command("list-plugins")
def list_plugins(
    as_json: bool = typer.Option(False, "--json", help="Print JSON: name, version, hooks, registrations."),
    include_builtins: bool = typer.Option(False, "--all", help="Include what the core registers itself."),
) -> None:
    """List installed plugins, the hooks they implement and what they registered."""
    host = get_host()
    rows = host.describe(include_builtins=include_builtins)
    if as_json:
        failures = [{"name": f.distribution or f.name, "error": f.error} for f in host.failures]
        typer.echo(json.dumps({"plugins": rows, "failed": failures}, indent=2))
        return
    table = Table(title="stitch plugins")
    for col in ("name", "version", "hooks", "registered"):
        table.add_column(col)
    for row in rows:
        registered = "\n".join(f"{k}: {', '.join(v)}" for k, v in row["registered"].items())
        table.add_row(row["name"], row["version"] or "-", "\n".join(row["hooks"]), registered)
    console.print(table)
    if not rows:
        console.print("No plugins installed. Try: pip install ./plugins/stitch-clip ./plugins/stitch-qwen")
    _print_failures()


def _registry_view(kind: str, columns: dict[str, Any], as_json: bool,
                   json_only: dict[str, Any] | None = None) -> None:
    host = get_host()
    regs = host.registrations(kind)
    records = [
        {"name": reg.name, "plugin": host._label(reg.plugin), **{c: fn(reg.spec) for c, fn in columns.items()},
         **{c: fn(reg.spec) for c, fn in (json_only or {}).items() if as_json}}
        for reg in regs
    ]
    if as_json:
        typer.echo(json.dumps(records, indent=2))
        return
    table = Table(title=f"stitch {kind.replace('_', ' ')}")
    for col in ("name", "plugin", *columns):
        table.add_column(col)
    for rec in records:
        table.add_row(*(str(rec[c]) for c in ("name", "plugin", *columns)))
    console.print(table)
    _print_failures()


_JSON = typer.Option(False, "--json", help="Print JSON instead of a table.")


@app.command()
def encoders(as_json: bool = _JSON) -> None:
    """Registered frozen encoders and their output contract."""
    _registry_view(
        "encoders",
        {
            "modality": lambda s: s.modality,
            "tokens": lambda s: s.tokens_per_item,
            "width": lambda s: s.feature_width,
            "source": lambda s: s.source.describe(),
        },
        as_json,
    )


@app.command()
def models(as_json: bool = _JSON) -> None:
    """Registered base language models, their sentinels, LoRA targets and whether they pack on this machine."""
    _registry_view(
        "models",
        {
            "architecture": lambda s: s.architecture,
            "hidden": lambda s: s.hidden_size,
            "sentinels": lambda s: s.sentinels,
            "lora_targets": lambda s: ",".join(s.lora_target_modules + s.lora_target_parameters),
            "packs_here": lambda s: s.packs(),
            "source": lambda s: s.source.describe(),
        },
        as_json,
        json_only={"packing_note": lambda s: s.packing_note},
    )


@app.command()
def sentinels(as_json: bool = _JSON) -> None:
    """Registered token sentinel sets (start / placeholder / end)."""
    _registry_view(
        "token_sentinels",
        {"start": lambda s: s.start, "placeholder": lambda s: s.placeholder, "end": lambda s: s.end},
        as_json,
    )


@app.command()
def registry(
    kind: str = typer.Argument(..., help=f"One of: {', '.join(KINDS)}"),
    as_json: bool = _JSON,
) -> None:
    """Any registry by kind (adapters, payloads, engines, projectors, recipes...)."""
    if kind not in KINDS:
        raise typer.BadParameter(f"unknown registry {kind!r}; expected one of {', '.join(KINDS)}")
    _registry_view(kind, {"description": lambda s: getattr(s, "description", "")}, as_json)


STAGES = ("alignment", "sft", "grpo", "dpo")


@app.command()
def train(
    stage: str = typer.Argument(..., help=f"One of: {', '.join(STAGES)}"),
    recipe: str = typer.Option(..., "--recipe", help="A registered recipe name or a YAML path."),
    out: Path = typer.Option(None, "--out", help="Run directory (default runs/<recipe name>)."),
    resume: bool = typer.Option(False, "--resume", help="Continue exactly from checkpoints/LATEST."),
    max_steps: int = typer.Option(None, "--max-steps", help="Stop after this many steps (for smoke runs)."),
) -> None:
    """Run one post-training stage of a recipe; prepared data is read from OUT/data."""
    from stitch.recipe import load_recipe

    if stage not in STAGES:
        raise typer.BadParameter(f"unknown stage {stage!r}; expected one of {', '.join(STAGES)}")
    from stitch.validate import validate_recipe

    loaded = load_recipe(recipe)
    validate_recipe(loaded)
    if stage not in loaded.stages:
        raise typer.BadParameter(f"recipe {loaded.name!r} has no stage {stage!r}; it has {sorted(loaded.stages)}")
    out = out or Path("runs") / loaded.name
    from stitch.distributed import launch_rank, launch_world_size

    if stage in ("grpo", "dpo") and launch_world_size() > 1:
        raise typer.BadParameter(
            f"{stage} runs in one process (WORLD_SIZE={launch_world_size()} here): only alignment and sft run "
            f"data parallel under torchrun; start `stitch train {stage}` without torchrun"
        )
    if stage in ("alignment", "sft"):
        from stitch.training import train_stage

        summary = train_stage(loaded, stage, out, resume=resume, max_steps=max_steps)
        if launch_rank() != 0:
            return
    elif stage == "grpo":
        from stitch.grpo import train_grpo

        summary = train_grpo(loaded, out, resume=resume, max_steps=max_steps)
    else:
        from stitch.dpo import train_dpo

        summary = train_dpo(loaded, out, resume=resume, max_steps=max_steps)
    _print_summary(stage, summary)


def _print_summary(stage: str, summary: dict[str, Any]) -> None:
    table = Table(title=f"{stage} summary")
    table.add_column("field")
    table.add_column("value")
    for key, value in summary.items():
        table.add_row(key, json.dumps(value) if isinstance(value, dict | list) else str(value))
    console.print(table)


@app.command("new-plugin")
def new_plugin(
    modality: str = typer.Argument(..., help="The modality's slug: spectrum, time_series, molecule..."),
    out: Path = typer.Option(Path("."), "--out", help="Directory to create the plugin project in."),
    tokens: int = typer.Option(None, "--tokens", help="Soft tokens per item (template default if omitted)."),
    width: int = typer.Option(None, "--width", help="Encoder feature width (template default if omitted)."),
) -> None:
    """Scaffold a modality plugin project: encoder, rollout payload, README walking the stages, tests."""
    from stitch.scaffold import ScaffoldError, render_plugin

    sizes = {"tokens_per_item": tokens, "feature_width": width}
    try:
        project = render_plugin(out, modality, **{k: v for k, v in sizes.items() if v is not None})
    except ScaffoldError as exc:
        typer.echo(f"cannot create the plugin: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"Created {project}")
    typer.echo(f"Next: cd {project} && pip install -e '.[test]' && pytest, then README.md step 3.")


@app.command()
def infer(
    adapter: Path = typer.Option(..., "--adapter", help="A checkpoints root (LATEST is used), a step dir, or a PEFT dir."),
    image: Path = typer.Option(..., "--image", help="The input file (an image for CLIP)."),
    question: str = typer.Option(..., "--question"),
    engine: str = typer.Option("embedded", "--engine", help="A registered rollout engine."),
    max_new_tokens: int = typer.Option(24, "--max-new-tokens"),
) -> None:
    """Answer a question about one input: encoder once, projector, merged adapter, engine."""
    from stitch.inference import Stitched

    if not image.is_file():
        raise typer.BadParameter(f"{image} does not exist", param_hint="--image")
    server = Stitched(adapter, engine=engine)
    console.print(f"checkpoint: {server.checkpoint.step_dir}", highlight=False)
    typer.echo(server.answer(image, question, max_new_tokens=max_new_tokens))


@app.command()
def run(
    recipe: str = typer.Argument("demo", help="A registered recipe name or a YAML path."),
    out: Path = typer.Option(None, "--out", help="Run directory (default runs/<recipe name>)."),
    fresh: bool = typer.Option(False, "--fresh", help="Re-run stages whose summary already exists."),
    dpo: bool = typer.Option(False, "--dpo", help="Also run the DPO stage after GRPO."),
) -> None:
    """The main job: prepare -> alignment -> SFT -> GRPO -> evaluation -> one inference."""
    from stitch.recipe import load_recipe
    from stitch.run import run_chain

    loaded = load_recipe(recipe)
    out = out or Path("runs") / loaded.name
    from stitch.run import DEFAULT_STAGES

    summary = run_chain(loaded, out, stages=DEFAULT_STAGES + (("dpo",) if dpo else ()), resume=not fresh)
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
    inf = summary["inference"]
    console.print(f"inference on {inf['image']} ({inf['objects']} objects): {inf['answer']!r}", highlight=False)
    console.print(f"summary: {out / 'summary.json'}; plots: {', '.join(summary['plots'])}", highlight=False)


@app.command()
def prepare(
    recipe: str = typer.Option(..., "--recipe", help="A registered recipe name or a YAML path."),
    out: Path = typer.Option(None, "--out", help="Output directory (default runs/<recipe name>/data)."),
    device: str = typer.Option("cpu", "--device", help="Where the encoder runs (cpu, cuda, cuda:1...)."),
) -> None:
    """Stream the recipe's dataset, encode each row once, write feature-cache/ + manifest.jsonl."""
    from stitch.feature_cache import FeatureCacheError
    from stitch.plugins import RegistryLookupError
    from stitch.prepare import PrepareError
    from stitch.prepare import prepare as run_prepare
    from stitch.recipe import RecipeError, load_recipe

    try:
        loaded = load_recipe(recipe)
        out = out or Path("runs") / loaded.name / "data"
        report = run_prepare(loaded, out, device=device)
    except (RecipeError, PrepareError, FeatureCacheError, RegistryLookupError) as exc:
        console.print(f"[red]prepare failed:[/red] {exc}", highlight=False)
        raise typer.Exit(1) from exc
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
    for skipped in report.skipped:
        console.print(
            f"[yellow]skipped row {skipped['id']!r} (position {skipped['position']}), column "
            f"{skipped['column']!r}:[/yellow] {skipped['reason']}",
            highlight=False,
        )


def main() -> None:
    """Console entry point: a user-facing error prints one clear line (STITCH_DEBUG=1 shows the traceback)."""
    import os
    import sys

    from stitch.plugins import PluginError, RegistryLookupError

    try:
        app()
    except (ValueError, FileNotFoundError, PluginError, RegistryLookupError) as exc:
        if os.environ.get("STITCH_DEBUG"):
            raise
        Console(stderr=True).print(f"[bold red]error:[/bold red] {exc}", highlight=False)
        sys.exit(2)
