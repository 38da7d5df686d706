"""Using a trained model: `stitch infer`."""

from __future__ import annotations

from pathlib import Path

import typer

from stitch.cli.app import app, console


@app.command()
def infer(
    adapter: Path = typer.Option(..., "--adapter", help="A checkpoints root (LATEST is used), a step dir, or a PEFT dir."),
    image: Path = typer.Option(..., "--image", help="The input file (an image for CLIP)."),
    question: str = typer.Option(..., "--question"),
    engine: str = typer.Option("embedded", "--engine", help="A registered rollout engine."),
    max_new_tokens: int = typer.Option(24, "--max-new-tokens"),
) -> None:
    """Answer a question about one input: encoder once, projector, merged adapter, engine."""
    from stitch.serve.inference import Stitched

    if not image.is_file():
        raise typer.BadParameter(f"{image} does not exist", param_hint="--image")
    server = Stitched(adapter, engine=engine)
    console.print(f"checkpoint: {server.checkpoint.step_dir}", highlight=False)
    typer.echo(server.answer(image, question, max_new_tokens=max_new_tokens))


