"""Using a trained model: `stitch infer` (one input or a JSONL of them), `stitch export`, `stitch serve`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import typer

from stitch.cli.app import app, console, err_console

_CHECKPOINT_HELP = "A checkpoints root (LATEST is used), a step dir, or a PEFT dir."


def _read_jsonl(path: Path) -> list[dict]:
    """Rows ``{image, question}`` or ``{images: [...], messages: [{role, content}, ...]}`` (a whole history ending
    with the user's turn; each image goes where its ``<image>`` marker stands), every field checked."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: line {number}: not JSON ({exc})") from exc
        if not isinstance(row, dict):
            raise ValueError(f"{path}: line {number}: expected a JSON object, got {row!r}")
        where = f"{path}: line {number}"
        images = _field(row, "images", "image", where, lambda v: isinstance(v, list) and v and all(
            isinstance(i, str) for i in v), "a non-empty list of file names")
        _field(row, "messages", "question", where, lambda v: isinstance(v, list) and v and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in v), "a list of {role, content} turns")
        resolved = []
        for image in images if isinstance(images, list) else [images]:
            full = Path(image) if Path(image).is_absolute() else path.parent / image
            if not full.is_file():
                raise ValueError(f"{where}: field 'image(s)': {full} does not exist")
            resolved.append(str(full))
        if "images" in row:
            row["images"] = resolved
        else:
            row["image"] = resolved[0]
        rows.append(row)
    return rows


def _field(row: dict, many: str, one: str, where: str, valid: Callable[[object], bool], shape: str) -> object:
    """``row[many]`` when it is there (checked), else ``row[one]``, a string."""
    if many in row:
        if not valid(row[many]):
            raise ValueError(f"{where}: field {many!r}: expected {shape}, got {row[many]!r}")
        return row[many]
    if not isinstance(row.get(one), str):
        raise ValueError(f"{where}: field {one!r}: expected a string (or {many!r}: {shape}), got {row.get(one)!r}")
    return row[one]


@app.command()
def infer(
    adapter: Path = typer.Option(..., "--adapter", help=_CHECKPOINT_HELP),
    image: Path = typer.Option(None, "--image", help="The input file (an image for CLIP)."),
    question: str = typer.Option(None, "--question"),
    input_rows: Path = typer.Option(None, "--input", help="JSONL rows {image, question[, id]} or {images, messages"
                                                           "[, id]} (a whole history): answer them all."),
    output: Path = typer.Option(None, "--output", help="With --input: JSONL answers (default: stdout)."),
    engine: str = typer.Option("embedded", "--engine", help="A registered rollout engine."),
    max_new_tokens: int = typer.Option(24, "--max-new-tokens"),
) -> None:
    """Answer questions about inputs: the model loads once; per input the encoder runs once, then projector and engine."""
    from tqdm.auto import tqdm

    from stitch.host.host import get_host
    from stitch.runs.atomic import write_text_atomic
    from stitch.serve.inference import Stitched

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
        media, prompt = row.get("images", row.get("image")), row.get("messages", row.get("question"))
        answers.append({**row, "answer": server.answer(media, prompt, max_new_tokens=max_new_tokens)})
    text = "".join(json.dumps(a) + "\n" for a in answers)
    if output is None:
        typer.echo(text, nl=False)
    else:
        write_text_atomic(output, text)
        console.print(f"{len(answers)} answers -> {output}", highlight=False)


@app.command()
def export(
    checkpoint: Path = typer.Argument(..., help="A run directory (its last stage's LATEST), or " + _CHECKPOINT_HELP),
    out: Path = typer.Option(..., "--out", help="Export directory."),
    format: str = typer.Option(
        "stitch", "--format", help="stitch: model/ (the merged LM, save_pretrained) + projector/ + "
        "stitch-export.json, for any encoder. llava: one transformers LLaVA directory (AutoModelForImageTextToText, "
        "AutoProcessor, the image-text-to-text pipeline), for CLIP-family encoders with an mlp2x_gelu or linear "
        "projector; other encoders are refused (use stitch)."),
) -> None:
    """Merge the adapter into the base LM and write it in the chosen format (see --format)."""
    from stitch.host.host import get_host
    from stitch.serve.export import export_checkpoint
    from stitch.serve.llava_export import export_llava

    if format not in ("stitch", "llava"):
        raise typer.BadParameter(f"expected stitch or llava, got {format!r}", param_hint="--format")
    if format == "llava":
        manifest = export_llava(_checkpoint_of(checkpoint), out, get_host())
        console.print(f"exported {manifest['base_model']} + {manifest['encoder']} as LLaVA from "
                      f"{manifest['checkpoint']} -> {out}", highlight=False)
        return
    manifest = export_checkpoint(_checkpoint_of(checkpoint), out, get_host())
    console.print(f"exported {manifest['base_model']} ({manifest['architecture']}) from {manifest['checkpoint']} "
                  f"-> {out}", highlight=False)


@app.command()
def serve(
    checkpoint: Path = typer.Argument(..., help="A run directory, or " + _CHECKPOINT_HELP),
    host: str = typer.Option("127.0.0.1", "--host", help="Bind address (loopback by default)."),
    port: int = typer.Option(8000, "--port"),
    model_name: str = typer.Option(None, "--model-name", help="The id clients send (default: the base model's name)."),
    max_image_pixels: int = typer.Option(40_000_000, "--max-image-pixels", help="Refuse larger images (400)."),
    max_request_mib: float = typer.Option(32, "--max-request-mib", help="Refuse larger request bodies (413)."),
    max_batch: int = typer.Option(32, "--max-batch", help="Most sequences decoded together in one batch."),
    request_timeout: float = typer.Option(600, "--request-timeout", help="Seconds a generation may take (504)."),
    header_timeout: float = typer.Option(10, "--header-timeout",
                                         help="Seconds a connection may stay open without sending request headers."),
    body_timeout: float = typer.Option(30, "--body-timeout", help="Seconds a request body may take to arrive (408)."),
) -> None:
    """Serve a checkpoint over an OpenAI-compatible API: POST /v1/chat/completions (streaming, n, sampling, several
    media per message, multi-turn), GET /v1/models, GET /health; concurrent requests are batched."""
    from stitch.host.host import get_host
    from stitch.serve.chat import Limits

    try:
        from stitch.serve.server import ServeLimits  # optional: the [serve] extra (fastapi, uvicorn)
        from stitch.serve.server import serve as run_server  # optional: the [serve] extra
    except ModuleNotFoundError as exc:
        err_console.print(f"stitch serve needs the serve extra: pip install 'stitch-lm[serve]' ({exc})")
        raise typer.Exit(2) from exc

    limits = ServeLimits(max_request_bytes=int(max_request_mib * 2**20), header_timeout_s=header_timeout,
                         body_timeout_s=body_timeout, request_timeout_s=request_timeout, max_batch_rows=max_batch,
                         chat=Limits(max_image_pixels=max_image_pixels))
    run_server(_checkpoint_of(checkpoint), get_host(), host=host, port=port, model_name=model_name, limits=limits,
               ready=lambda url: console.print(f"serving at {url}", highlight=False))


def _checkpoint_of(path: Path) -> Path:
    """A run directory stands for the checkpoints of its final policy, the last stage of the chain that ran: DPO's,
    else GRPO's, else SFT's."""
    for stage in ("dpo", "grpo", "sft"):
        if (path / stage / "checkpoints" / "LATEST").is_file():
            return path / stage / "checkpoints"
    return path
