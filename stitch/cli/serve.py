"""Using a trained model: `stitch infer` (one input or a JSONL of them), `stitch export`, `stitch serve`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import typer

from stitch.cli.app import app, console, err_console
from stitch.host.host import get_host
from stitch.runs.atomic import write_text_atomic
from stitch.runs.progress import progress

_CHECKPOINTS = "a checkpoints root (LATEST is used), a step dir, or a PEFT dir."


_MEDIA_KEYS = ("media", "images", "image")  # `images` and `image` are older names of `media`


def _row_media(row: dict, where: str, base: Path) -> list[str]:
    """A row's input files (``media``: one path or a list; ``images``/``image`` the same), made absolute against
    ``base`` and checked to exist; raises a one-line error naming ``where`` and the field."""
    given = [key for key in _MEDIA_KEYS if key in row]
    if len(given) != 1:
        raise ValueError(f"{where}: expected one of the fields 'media', 'images' or 'image' (an input file path or "
                         f"a list of them), got {sorted(row)}")
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
    """The rows of ``--input`` (``{media, question}`` or ``{media, messages: [{role, content}, ...]}``, a whole
    history ending with the user's turn, each item where its ``<image>`` marker stands), each with its input files,
    all checked before the model loads."""
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
        _field(row, "messages", "question", where, lambda v: isinstance(v, list) and v and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in v), "a list of {role, content} turns")
        rows.append((row, _row_media(row, where, path.parent)))
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
    adapter: Path = typer.Option(..., "--adapter", help=_CHECKPOINTS[0].upper() + _CHECKPOINTS[1:]),
    media: list[Path] = typer.Option(
        None, "--media", "--image",
        help="An input file for the recipe's encoder (an image, a .npy signal, audio...); repeat it for several "
             "items in one prompt. --image is another name for it."),
    question: str = typer.Option(None, "--question"),
    input_rows: Path = typer.Option(
        None, "--input", help="JSONL rows {media, question[, id]} or {media, messages[, id]} (a whole history; "
                              "media: a path or a list; 'image(s)' also read): answer them all."),
    output: Path = typer.Option(None, "--output", help="With --input: JSONL answers (default: stdout)."),
    engine: str = typer.Option("embedded", "--engine", help="A registered rollout engine."),
    max_new_tokens: int = typer.Option(24, "--max-new-tokens"),
) -> None:
    """Answer questions about inputs: the model loads once; per input the encoder runs once, then projector and engine."""
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
    from stitch.serve.inference import Stitched  # deferred: torch + transformers, past the rows' checks

    server = Stitched(adapter, get_host(), engine=engine)
    err_console.print(f"checkpoint: {server.checkpoint.step_dir}", highlight=False)
    if input_rows is None:
        typer.echo(server.answer(rows[0][1], question, max_new_tokens=max_new_tokens))
        return
    answers = []
    with progress(len(rows), "infer", enabled=output is not None) as bar:
        for row, files in rows:
            prompt = row.get("messages", row.get("question"))
            answers.append({**row, "answer": server.answer(files, prompt, max_new_tokens=max_new_tokens)})
            bar.update(1)
    text = "".join(json.dumps(a) + "\n" for a in answers)
    if output is None:
        typer.echo(text, nl=False)
    else:
        write_text_atomic(output, text)
        console.print(f"{len(answers)} answers -> {output}", highlight=False)


@app.command()
def export(
    checkpoint: Path = typer.Argument(..., help="A run directory (its last stage's LATEST), or " + _CHECKPOINTS),
    out: Path = typer.Option(..., "--out", help="Export directory."),
    format: str = typer.Option(
        "stitch", "--format", help="stitch: model/ (the merged LM, save_pretrained) + projector/ + "
        "stitch-export.json, for any encoder. llava: one transformers LLaVA directory (AutoModelForImageTextToText, "
        "AutoProcessor, the image-text-to-text pipeline), for CLIP-family encoders with an mlp2x_gelu or linear "
        "projector; other encoders are refused (use stitch)."),
) -> None:
    """Merge the adapter into the base LM and write it in the chosen format (see --format).

    A full fine-tune's checkpoint holds the LM's own weights: those are written in place of the base's."""
    from stitch.serve.export import export_checkpoint  # deferred: stitch --help skips torch
    from stitch.serve.llava_export import export_llava  # deferred: stitch --help skips torch

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
    checkpoint: Path = typer.Argument(..., help="A run directory, or " + _CHECKPOINTS),
    host: str = typer.Option("127.0.0.1", "--host", help="Bind address (loopback by default)."),
    port: int = typer.Option(8000, "--port"),
    model_name: str = typer.Option(None, "--model-name", help="The id clients send (default: the base model's name)."),
    max_image_pixels: int = typer.Option(40_000_000, "--max-image-pixels", help="Refuse larger images (400)."),
    max_request_mib: float = typer.Option(32, "--max-request-mib", help="Refuse larger request bodies (413)."),
    max_batch: int = typer.Option(32, "--max-batch", help="Most sequences decoded together in one batch."),
    batch_wait_ms: float = typer.Option(0, "--batch-wait-ms", min=0,
                                        help="How long a batch's first request waits for others to join it."),
    request_timeout: float = typer.Option(600, "--request-timeout", help="Seconds a generation may take (504)."),
    header_timeout: float = typer.Option(10, "--header-timeout",
                                         help="Seconds a connection may stay open without sending request headers."),
    body_timeout: float = typer.Option(30, "--body-timeout", help="Seconds a request body may take to arrive (408)."),
) -> None:
    """Serve a checkpoint over an OpenAI-compatible API; concurrent requests are batched.

    POST /v1/chat/completions (streaming, n, sampling, several media per message, multi-turn), GET /v1/models,
    GET /health."""
    from stitch.serve.chat import Limits  # deferred: stitch --help skips torch (via the batching engine)

    try:
        from stitch.serve.server import ServeLimits  # optional: the [serve] extra (fastapi, uvicorn)
        from stitch.serve.server import serve as run_server  # optional: the [serve] extra
    except ModuleNotFoundError as exc:
        err_console.print(f"stitch serve needs the serve extra: pip install 'stitch-lm[serve]' ({exc})")
        raise typer.Exit(2) from exc

    limits = ServeLimits(max_request_bytes=int(max_request_mib * 2**20), header_timeout_s=header_timeout,
                         body_timeout_s=body_timeout, request_timeout_s=request_timeout, max_batch_rows=max_batch,
                         batch_wait_s=batch_wait_ms / 1000,
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
