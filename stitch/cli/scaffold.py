"""`stitch new-plugin`: scaffold a modality plugin project from the cookiecutter template."""

from __future__ import annotations

from pathlib import Path

import typer

from stitch.cli.app import app
from stitch.scaffold import ScaffoldError, render_plugin


@app.command("new-plugin")
def new_plugin(
    modality: str = typer.Argument(..., help="The modality's slug: spectrum, time_series, molecule..."),
    out: Path = typer.Option(Path("."), "--out", help="Directory to create the plugin project in."),
    tokens: int = typer.Option(None, "--tokens", help="Soft tokens per item (template default if omitted)."),
    width: int = typer.Option(None, "--width", help="Encoder feature width (template default if omitted)."),
) -> None:
    """Scaffold a modality plugin project: encoder, rollout payload, README walking the stages, tests."""
    sizes = {"tokens_per_item": tokens, "feature_width": width}
    try:
        project = render_plugin(out, modality, **{k: v for k, v in sizes.items() if v is not None})
    except ScaffoldError as exc:
        typer.echo(f"cannot create the plugin: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"Created {project}")
    typer.echo(f"Next: cd {project} && pip install -e '.[test]' && pytest, then README.md step 3.")


