"""``stitch run``: the whole chain on one recipe: prepare -> alignment -> SFT -> GRPO (-> DPO) ->
evaluation -> one inference, with a summary table, ``summary.json`` and PNG plots."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from stitch.config.recipe import Recipe
from stitch.runs.checkpoint import write_text_atomic

DEFAULT_STAGES = ("alignment", "sft", "grpo")


def run_chain(recipe: Recipe, out_dir: Path, *, stages: tuple[str, ...] = DEFAULT_STAGES, resume: bool = True,
              progress: bool = True) -> dict[str, Any]:
    """Prepare, then run ``stages`` (those the recipe defines), evaluate, and answer one new input; a stage
    whose summary exists is skipped on re-run."""
    from stitch.config.validate import validate_recipe
    from stitch.data.prepare import prepare
    from stitch.stages.dpo import train_dpo
    from stitch.stages.grpo import train_grpo
    from stitch.stages.plots import plot_run
    from stitch.stages.supervised import train_stage

    validate_recipe(recipe)  # every stage's options, before any data or weights are touched
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"recipe": recipe.name, "model": recipe.model, "encoder": recipe.encoder, "stages": {}}
    t0 = time.perf_counter()
    t = time.perf_counter()
    report = prepare(recipe, out_dir / "data", progress=progress)
    summary["stages"]["prepare"] = {**_jsonable(report), "seconds": round(time.perf_counter() - t, 2)}
    runners = {
        "alignment": lambda: train_stage(recipe, "alignment", out_dir, progress=progress),
        "sft": lambda: train_stage(recipe, "sft", out_dir, progress=progress),
        "grpo": lambda: train_grpo(recipe, out_dir, progress=progress),
        "dpo": lambda: train_dpo(recipe, out_dir, progress=progress),
    }
    for stage in ("alignment", "sft", "grpo", "dpo"):
        if stage not in recipe.stages or stage not in stages:
            continue
        done = out_dir / stage / "summary.json"
        if resume and done.is_file():
            summary["stages"][stage] = json.loads(done.read_text())
            continue
        summary["stages"][stage] = runners[stage]()
    last = next(s for s in ("grpo", "dpo", "sft") if s in summary["stages"])
    summary["inference"] = infer_demo_image(out_dir, out_dir / last / "checkpoints")
    summary["chance_accuracy"] = 0.2 if recipe.data.source.__class__.__name__ == "BuiltinSource" else None
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    summary["plots"] = [str(p) for p in plot_run(out_dir, summary)]
    write_text_atomic(out_dir / "summary.json", json.dumps(summary, indent=2))
    return summary


def infer_demo_image(out_dir: Path, checkpoint: Path, seed: int = 2026) -> dict[str, Any]:
    """One inference on a new image (a fresh demo scene, not in the prepared data)."""
    import random

    from stitch.demo.data import render_scene, sample_scene
    from stitch.demo.tiny import COUNT_QUESTION
    from stitch.serve.inference import Stitched

    objects = sample_scene(random.Random(seed))
    image_path = out_dir / "inference.png"
    render_scene(objects).save(image_path)
    t = time.perf_counter()
    server = Stitched(checkpoint)
    answer = server.answer(image_path, COUNT_QUESTION)
    return {"checkpoint": str(server.checkpoint.step_dir), "image": str(image_path), "question": COUNT_QUESTION,
            "answer": answer, "objects": len(objects), "seconds": round(time.perf_counter() - t, 2)}


def _jsonable(value: Any) -> Any:
    if hasattr(value, "as_dict"):
        return value.as_dict()
    if hasattr(value, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(value)
    return value
