"""Using a trained model: `stitch infer` (one input or a JSONL of them), `stitch export`, `stitch serve`."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from stitch.cli.app import app, console, err_console

_CHECKPOINT_HELP = "A checkpoints root (LATEST is used), a step dir, or a PEFT dir."


_MEDIA_KEYS = ("media", "image")  # `image` is the older name of `media`; a row gives one of them


def _row_media(row: dict, where: str, base: Path) -> list[str]:
    """A row's input files (``media``: one path or a list; ``image`` the same), made absolute against ``base``
    and checked to exist; raises a one-line error naming ``where`` and the field."""
    given = [key for key in _MEDIA_KEYS if key in row]
    if len(given) != 1:
        raise ValueError(f"{where}: expected one of the fields 'media' or 'image' (an input file path or a "
                         f"list of them), got {sorted(row)}")
    key = given[0]
    value = row[key]
    paths = value if isinstance(value, list) else [value]
    if not paths or not all(isinstance(p, str) for p in paths):
        raise ValueError(f"{where}: field {key!r}: expected a file path or a non-empty list of them, got {value!r}")
    resolved = [Path(p) if Path(p).is_absolute() else base / p for p in paths]
    for path in resolved:
        if not path.is_file():
            raise ValueError(f"{where}: field {key!r}: {path} does not exist")
    return [str(p) for p in resolved]


def _read_jsonl(path: Path) -> list[tuple[dict, list[str]]]:
    """The rows of ``--input``, each with its input files, all checked before the model loads."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}: line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc})") from exc
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object {{media, question[, id]}}, got {row!r}")
        if not isinstance(row.get("question"), str):
            raise ValueError(f"{where}: field 'question': expected a string, got {row.get('question')!r}")
        rows.append((row, _row_media(row, where, path.parent)))
    return rows


@app.command()
def infer(
    adapter: Path = typer.Option(..., "--adapter", help=_CHECKPOINT_HELP),
    media: list[Path] = typer.Option(
        None, "--media", "--image",
        help="An input file for the recipe's encoder (an image, a .npy signal, audio...); repeat it for several "
             "items in one prompt. --image is another name for it."),
    question: str = typer.Option(None, "--question"),
    input_rows: Path = typer.Option(
        None, "--input", help="JSONL rows {media, question[, id]} (media: a path or a list; 'image' also read): "
                              "answer them all."),
    output: Path = typer.Option(None, "--output", help="With --input: JSONL answers (default: stdout)."),
    engine: str = typer.Option("embedded", "--engine", help="A registered rollout engine."),
    max_new_tokens: int = typer.Option(24, "--max-new-tokens"),
) -> None:
    """Answer questions about inputs: the model loads once; per input the encoder runs once, then projector and engine."""
    from stitch.host.host import get_host
    from stitch.runs.atomic import write_text_atomic
    from stitch.runs.progress import progress
    from stitch.serve.inference import Stitched

    if input_rows is None:
        if not media or question is None:
            raise typer.BadParameter("give --media FILE and --question, or --input ROWS.jsonl")
        for path in media:
            if not path.is_file():
                raise typer.BadParameter(f"{path} does not exist", param_hint="--media")
        rows = [({"question": question}, [str(p) for p in media])]
    else:
        if media or question is not None:
            raise typer.BadParameter("--input answers a JSONL of rows; do not also give --media/--question")
        rows = _read_jsonl(input_rows)  # every row checked before the model loads
    server = Stitched(adapter, get_host(), engine=engine)
    err_console.print(f"checkpoint: {server.checkpoint.step_dir}", highlight=False)
    if input_rows is None:
        typer.echo(server.answer_items(rows[0][1], question, max_new_tokens=max_new_tokens))
        return
    answers = []
    with progress(len(rows), "infer", enabled=output is not None) as bar:
        for row, files in rows:
            answer = server.answer_items(files, row["question"], max_new_tokens=max_new_tokens)
            answers.append({**row, "answer": answer})
            bar.update(1)
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
    from stitch.host.host import get_host
    from stitch.serve.export import export_checkpoint

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
    from stitch.host.host import get_host
    from stitch.serve.server import serve as run_server

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
