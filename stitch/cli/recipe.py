"""`stitch recipe show` (the resolved recipe, overrides applied) and `stitch recipe schema` (its JSON schema)."""

from __future__ import annotations

import json

import typer

from stitch.cli.app import app
from stitch.config.describe import reference_markdown
from stitch.config.recipe import load_recipe, recipe_json_schema
from stitch.config.schema import RecipeFile
from stitch.host.host import get_host

recipe_app = typer.Typer(no_args_is_help=True, help="Resolve a recipe with overrides; print the recipe schema.")
app.add_typer(recipe_app, name="recipe")


@recipe_app.command("show")
def show(
    recipe: str = typer.Argument(..., help="A registered recipe name or a YAML path."),
    overrides: list[str] = typer.Argument(None, help="key=value overrides, e.g. stages.sft.steps=50 "
                                                     "'stages.sft.lora={r: 8, alpha: 16}'."),
) -> None:
    """Print the resolved recipe as YAML: every option, defaults and overrides applied (what a run keeps)."""
    loaded = load_recipe(recipe, get_host(), overrides=tuple(overrides or ()))
    typer.echo(f"# {loaded.path or loaded.name}" + (f" with {' '.join(overrides)}" if overrides else ""))
    typer.echo(f"# sha256 {loaded.digest}")
    typer.echo(loaded.resolved_yaml(), nl=False)


@recipe_app.command("schema")
def schema(
    markdown: bool = typer.Option(False, "--markdown", help="Print the option reference table of docs/recipes.md."),
) -> None:
    """Print the JSON schema of a recipe file (or the option reference as a markdown table)."""
    text = reference_markdown(RecipeFile) if markdown else json.dumps(recipe_json_schema(), indent=2) + "\n"
    typer.echo(text, nl=False)
