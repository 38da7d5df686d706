"""Using a trained model: `stitch infer` (one input or a JSONL of them), `stitch export`, `stitch serve`."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from stitch.cli.app import app, console, err_console
from stitch.host.host import get_host
from stitch.runs.atomic import write_text_atomic

_CHECKPOINT_HELP = "A checkpoints root (LATEST is used), a step dir, or a PEFT dir."


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: line {number}: not JSON ({exc})") from exc
        for key in ("image", "question"):
            if not isinstance(row, dict) or not isinstance(row.get(key), str):
                raise ValueError(f"{path}: line {number}: field {key!r}: expected a string, got "
                                 f"{row.get(key) if isinstance(row, dict) else row!r}")
        image = Path(row["image"])
        row["image"] = str(image if image.is_absolute() else path.parent / image)
        if not Path(row["image"]).is_file():
            raise ValueError(f"{path}: line {number}: field 'image': {row['image']} does not exist")
        rows.append(row)
    return rows


@app.command()
def infer(
    adapter: Path = typer.Option(..., "--adapter", help=_CHECKPOINT_HELP),
    image: Path = typer.Option(None, "--image", help="The input file (an image for CLIP)."),
    question: str = typer.Option(None, "--question"),
    input_rows: Path = typer.Option(None, "--input", help="JSONL rows {image, question[, id]}: answer them all."),
    output: Path = typer.Option(None, "--output", help="With --input: JSONL answers (default: stdout)."),
    engine: str = typer.Option("embedded", "--engine", help="A registered rollout engine."),
    max_new_tokens: int = typer.Option(24, "--max-new-tokens"),
) -> None:
    """Answer questions about inputs: the model loads once; per input the encoder runs once, then projector and engine."""
    from tqdm.auto import tqdm  # deferred: stitch --help skips tqdm.auto (0.2 s: asyncio)

    from stitch.serve.inference import Stitched  # deferred: stitch --help skips torch

    if input_rows is None:
        if image is None or question is None:
            raise typer.BadParameter("give --image and --question, or --input ROWS.jsonl")
        if not image.is_file():
            raise typer.BadParameter(f"{image} does not exist", param_hint="--image")
        rows = [{"image": str(image), "question": question}]
    else:
        if image is not None or question is not None:
            raise typer.BadParameter("--input answers a JSONL of rows; do not also give --image/--question")
        rows = _read_jsonl(input_rows)  # every row checked before the model loads
    server = Stitched(adapter, get_host(), engine=engine)
    err_console.print(f"checkpoint: {server.checkpoint.step_dir}", highlight=False)
    if input_rows is None:
        typer.echo(server.answer(rows[0]["image"], rows[0]["question"], max_new_tokens=max_new_tokens))
        return
    answers = []
    for row in tqdm(rows, desc="infer", disable=output is None):
        answers.append({**row, "answer": server.answer(row["image"], row["question"], max_new_tokens=max_new_tokens)})
    text = "".join(json.dumps(a) + "\n" for a in answers)
    if output is None:
        typer.echo(text, nl=False)
    else:
        write_text_atomic(output, text)
        console.print(f"{len(answers)} answers -> {output}", highlight=False)


@app.command()
def export(
    checkpoint: Path = typer.Argument(..., help="A run directory (its last stage's LATEST), or " + _CHECKPOINT_HELP),
    out: Path = typer.Option(..., "--out", help="Export directory: model/ (merged, save_pretrained), projector/."),
) -> None:
    """Merge the adapter into the base LM and save it with save_pretrained, beside the projector artifact."""
    from stitch.serve.export import export_checkpoint  # deferred: stitch --help skips torch

    manifest = export_checkpoint(_checkpoint_of(checkpoint), out, get_host())
    console.print(f"exported {manifest['base_model']} ({manifest['architecture']}) from {manifest['checkpoint']} "
                  f"-> {out}", highlight=False)


@app.command()
def serve(
    checkpoint: Path = typer.Argument(..., help="A run directory, or " + _CHECKPOINT_HELP),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    engine: str = typer.Option("embedded", "--engine", help="A registered rollout engine."),
    model_name: str = typer.Option(None, "--model-name", help="The id clients send (default: the base model's name)."),
    max_image_pixels: int = typer.Option(40_000_000, "--max-image-pixels", help="Refuse larger images (400)."),
) -> None:
    """Serve a checkpoint over an OpenAI-compatible API: GET /v1/models, POST /v1/chat/completions."""
    from stitch.serve.server import serve as run_server  # deferred: stitch --help skips torch

    def ready(server) -> None:
        address = f"http://{server.server_address[0]}:{server.server_address[1]}/v1"
        console.print(f"serving {server.model_name!r} at {address}", highlight=False)

    run_server(_checkpoint_of(checkpoint), get_host(), host=host, port=port, engine=engine,
               model_name=model_name,
               max_pixels=max_image_pixels, ready=ready)


def _checkpoint_of(path: Path) -> Path:
    """A run directory stands for the checkpoints of its final policy: GRPO's, else DPO's, else SFT's."""
    for stage in ("grpo", "dpo", "sft"):
        if (path / stage / "checkpoints" / "LATEST").is_file():
            return path / stage / "checkpoints"
    return path
