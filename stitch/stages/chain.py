"""``stitch run``: the whole chain on one recipe: prepare -> alignment -> SFT -> GRPO (-> DPO) -> evaluation of
the final checkpoint through the serving path -> answers to a few held-out rows, with ``summary.json`` and plots.

Nothing here knows the dataset or the modality: rows come from the recipe's prepared eval partition (their
cached features), prompts go through the encoder's rollout payload, and the recipe's task grades the answers.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from stitch.config.options import STAGE_OPTIONS
from stitch.config.recipe import Recipe
from stitch.data.feature_cache import PreparedData
from stitch.data.prepare import prepare
from stitch.data.prepare_report import REPORT_NAME, PrepareReport
from stitch.demo.data import builtin_parquet
from stitch.model.binding import ModelBinding
from stitch.plugins.registry import Registry
from stitch.rollout.prompts import payload_for
from stitch.runs.atomic import write_text_atomic
from stitch.runs.cleanup import CreatedPaths, leave_as_found
from stitch.runs.environment import environment
from stitch.runs.lock import RunLock
from stitch.serve.inference import Stitched
from stitch.stages.evaluation import greedy_answers
from stitch.stages.loop import run_stage
from stitch.stages.plots import plot_run
from stitch.stages.registry import STAGES
from stitch.tasks import check_task, majority_baseline, resolve_task, scorer_name

DEFAULT_STAGES = ("alignment", "sft", "grpo")
# the checkpoint the chain serves: GRPO's when it ran (it refines SFT), else DPO's, else SFT's
POLICY_STAGES = ("sft", "grpo", "dpo")  # stages that leave an adapter (or SFT's full LM weights) to serve, in order
INFERENCE_ROWS = 3


def run_chain(recipe: Recipe, out_dir: Path, *, registry: Registry, stages: tuple[str, ...] = DEFAULT_STAGES,
              resume: bool = True, progress: bool = True, zeroed_control: bool = True) -> dict[str, Any]:
    """Prepare, run ``stages`` (those the recipe defines; a stage whose summary exists is skipped on re-run),
    then grade the final checkpoint on the eval partition and answer a few of its rows. ``recipe`` is already
    validated against ``registry`` (``stitch.host.validate``), which every stage and the evaluation look the
    recipe's names up in.

    Returns (and writes as ``summary.json``) ``recipe, model, encoder, task, stages{name: stage summary},
    final_stage, evaluation, inference, seconds, plots``; see ``evaluate_final`` for ``evaluation`` and
    ``inference``.
    """
    # a refusal before the data is prepared leaves OUT as it was found (prepare's report of skipped rows aside)
    with leave_as_found(Path(out_dir), keep=(REPORT_NAME,)) as created, RunLock(Path(out_dir), "run"):
        # one process per run directory; the stages below re-enter it
        return _run_chain(recipe, registry, Path(out_dir), stages, resume, progress, zeroed_control, created)


def prepare_data(recipe: Recipe, binding: ModelBinding, out_dir: Path, *, encoder: Any = None, device: str = "cpu",
                 progress: bool = True) -> PrepareReport:
    """``stitch.data.prepare.prepare`` with what the recipe resolved to: the encoder spec, the tokenizer and the
    sentinel ids of ``binding``, and the demo's generator for a built-in source."""
    return prepare(recipe, out_dir, encoder_spec=binding.encoder_spec, tokenizer=binding.tokenizer,
                   sentinel_ids=binding.sentinel_ids, builtin=builtin_parquet, encoder=encoder, device=device,
                   progress=progress)


def _run_chain(recipe: Recipe, registry: Registry, out_dir: Path, stages: tuple[str, ...], resume: bool,
               progress: bool, zeroed_control: bool, created: CreatedPaths) -> dict[str, Any]:
    task = check_task(recipe, registry)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"recipe": recipe.name, "model": recipe.model, "encoder": recipe.encoder,
                               "task": task.name, "environment": environment(), "stages": {}}
    t0 = time.perf_counter()
    t = time.perf_counter()
    binding = ModelBinding.for_recipe(recipe, registry, device="cpu")  # the tokenizer only: no weights load
    report = prepare_data(recipe, binding, out_dir / "data", progress=progress)
    summary["stages"]["prepare"] = {**_jsonable(report), "seconds": round(time.perf_counter() - t, 2)}
    created.commit()  # prepared data is a result: a later stage's failure keeps it for the re-run to reuse
    for stage in STAGES:  # the stage table's order
        if stage not in recipe.stages or stage not in stages:
            continue
        done = out_dir / stage / "summary.json"
        if resume and done.is_file():
            summary["stages"][stage] = json.loads(done.read_text())
            continue
        summary["stages"][stage] = run_stage(recipe, stage, out_dir, registry=registry, progress=progress)
    final = final_stage(summary["stages"])
    summary["final_stage"] = final
    if final is None:
        summary["evaluation"] = summary["inference"] = None  # alignment alone leaves no adapter to serve
    else:
        evaluation, inference = evaluate_final(recipe, registry, out_dir, final, zeroed_control=zeroed_control)
        summary["evaluation"], summary["inference"] = evaluation, inference
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    summary["plots"] = [str(p) for p in plot_run(out_dir, summary)]
    write_text_atomic(out_dir / "summary.json", json.dumps(summary, indent=2))
    return summary


def final_stage(ran: Mapping[str, Any]) -> str | None:
    """The last stage in chain order among those that ran and leave an adapter: what the chain evaluates."""
    return next((s for s in reversed(STAGES) if s in POLICY_STAGES and s in ran), None)


def stage_partitions(recipe: Recipe, stage: str) -> list[str]:
    """The partitions a stage trains on: its data mixture's, or its one partition."""
    mixture = getattr(recipe.stages.get(stage), "mixture", None)
    return list(mixture) if mixture is not None else [stage_option(recipe, stage, "partition")]


def stage_option(recipe: Recipe, stage: str, key: str, default: Any = None) -> Any:
    """One stage option, whether the recipe holds raw mappings or typed options objects."""
    options = recipe.stages.get(stage)
    if options is None:
        return default
    if isinstance(options, Mapping):
        return options.get(key, default)
    return getattr(options, key, default)


def eval_partition(recipe: Recipe, final: str) -> tuple[str | None, int | None]:
    """(partition, rows) the chain grades: the final stage's eval partition, else another stage's."""
    for stage in (final, *STAGE_OPTIONS):
        if stage not in recipe.stages:
            continue
        partition = stage_option(recipe, stage, "eval_partition", "eval")  # the stage options' default
        if partition:
            return partition, stage_option(recipe, stage, "eval_rows", 64)
    return None, None


def evaluate_final(recipe: Recipe, registry: Registry, out_dir: Path, final: str, *, zeroed_control: bool = True,
                   inference_rows: int = INFERENCE_ROWS) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Grade ``final``'s checkpoint, served as inference serves it (adapter merged, the rollout engine), on the
    recipe's eval partition from cached features; answer the first ``inference_rows`` of them.

    ``evaluation``: ``{checkpoint, stage, partition, task, rows, accuracy, zeroed_features_accuracy,
    majority_baseline: {answer, accuracy, rows}, seconds}`` (None without an eval partition);
    ``inference``: ``{checkpoint, partition, held_out, rows: [{id, question, expected, answer, score}],
    question, expected, answer, score, seconds}`` (the top-level four repeat the first row).
    """
    t = time.perf_counter()
    server = Stitched(out_dir / final / "checkpoints", registry)
    task = resolve_task(recipe, registry)
    data = PreparedData(out_dir / "data")
    payload = payload_for(server.binding.registry, server.encoder_spec)

    def answer(rows: list[Any], zero_features: bool = False, batch_size: int = 16) -> list[dict[str, Any]]:
        records = []
        for i in range(0, len(rows), batch_size):
            chunk = rows[i : i + batch_size]
            prompts = [(row.id, server.binding.prompt_ids(row.prompt_messages, row.num_items), data.features(row))
                       for row in chunk]
            texts = greedy_answers(payload, server.model, server.engine, server.tokenizer, prompts,
                                   zero_features=zero_features)
            records += [{"id": row.id, "question": row.question, "expected": row.answer, "answer": text,
                         "score": task.score(text, row.task_row())} for row, text in zip(chunk, texts, strict=True)]
        return records

    checkpoint = str(server.checkpoint.step_dir)
    partition, limit = eval_partition(recipe, final)
    evaluation = None
    if partition is not None:
        rows = [r for r in data.rows(partition) if task.takes(r.task_row())][: limit or None]
        if not rows:
            raise ValueError(f"stitch run: eval partition {partition!r} has no rows that task {task.name!r} can "
                             f"grade (TaskSpec.accepts refused every row)")
        graded = answer(rows)
        evaluation = {
            "checkpoint": checkpoint, "stage": final, "partition": partition, "task": task.name,
            "scorer": scorer_name(recipe, task),
            "rows": len(rows), "accuracy": _mean(r["score"] for r in graded),
            "zeroed_features_accuracy": _mean(r["score"] for r in answer(rows, zero_features=True))
            if zeroed_control else None,
            "majority_baseline": majority_baseline(task, [r.task_row() for r in rows]),
            "seconds": round(time.perf_counter() - t, 2),
        }
        shown, held_out = graded[:inference_rows], True
    else:
        # no eval partition: answer rows no stage trains on, else (said so) rows of the final stage's partition
        trained = {name for s in recipe.stages for name in stage_partitions(recipe, s)}
        spare = [p.name for p in recipe.partitions if p.name not in trained]
        partition = spare[0] if spare else stage_partitions(recipe, final)[0]
        held_out = bool(spare)
        shown = answer([r for r in data.rows(partition) if task.takes(r.task_row())][:inference_rows])
    first = shown[0] if shown else {}
    inference = {"checkpoint": checkpoint, "partition": partition, "held_out": held_out, "rows": shown,
                 **{k: first.get(k) for k in ("question", "expected", "answer", "score")},
                 "seconds": round(time.perf_counter() - t, 2)}
    return evaluation, inference


def _mean(values: Any) -> float:
    values = list(values)
    return sum(values) / len(values)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "as_dict"):
        return value.as_dict()
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    return value
