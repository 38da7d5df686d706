"""Registry views: plugins, encoders, models, sentinels and any registry by kind."""

from __future__ import annotations

import json
from typing import Any

import typer

from stitch.cli.app import app, console, print_table, wrapping_table
from stitch.host.host import get_host
from stitch.plugins.hookspecs import HOOKS


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
    listing = wrapping_table("stitch plugins", "name", "version", "hooks", "registered")
    for row in rows:
        registered = "\n".join(f"{k}: {', '.join(v)}" for k, v in row["registered"].items())
        listing.add_row(row["name"], row["version"] or "-", "\n".join(row["hooks"]), registered)
    print_table(listing)
    if not rows:
        console.print("No plugins installed. Try: pip install ./plugins/stitch-clip ./plugins/stitch-qwen")
    _print_failures()


def _registry_view(kind: str, columns: dict[str, Any], as_json: bool,
                   json_only: dict[str, Any] | None = None) -> None:
    host = get_host()
    regs = host.registrations(kind)
    records = [
        {"name": reg.name, "plugin": host.label(reg.plugin), **{c: fn(reg.spec) for c, fn in columns.items()},
         **{c: fn(reg.spec) for c, fn in (json_only or {}).items() if as_json}}
        for reg in regs
    ]
    if as_json:
        typer.echo(json.dumps(records, indent=2))
        return
    view = wrapping_table(f"stitch {kind.replace('_', ' ')}", "name", "plugin", *columns)
    for rec in records:
        view.add_row(*(str(rec[c]) for c in ("name", "plugin", *columns)))
    print_table(view)
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
        json_only={"packing_note": lambda s: s.packing_note,
                   "snapshot": lambda s: s.snapshot is not None},  # `stitch snapshot` can write its layout
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
    kind: str = typer.Argument(..., help=f"One of: {', '.join(HOOKS)}"),
    as_json: bool = _JSON,
) -> None:
    """Any registry by kind (adapters, payloads, engines, projectors, recipes...)."""
    if kind not in HOOKS:
        raise typer.BadParameter(f"unknown registry {kind!r}; expected one of {', '.join(HOOKS)}")
    _registry_view(kind, {"description": lambda s: getattr(s, "description", "")}, as_json)


