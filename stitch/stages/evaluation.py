"""Held-out evaluation: greedy answers generated from prompt embeddings (built through the rollout payload of
the recipe's encoder), graded by the recipe's task; plus the majority-answer baseline they are read against."""

from __future__ import annotations

from typing import Any

from stitch.plugins.specs import TaskSpec
from stitch.rollout.engines import EmbeddedEngine
from stitch.rollout.prompts import payload_for, prompt_embeddings
from stitch.tasks import majority_baseline, resolve_task


def recipe_task(session: Any) -> TaskSpec:
    return resolve_task(session.recipe, session.registry)


def graded_rows(session: Any, partition: str, task: TaskSpec, limit: int | None = None) -> list[Any]:
    """The first ``limit`` manifest rows of ``partition`` that ``task`` can grade."""
    rows = [r for r in session.data.rows(partition) if task.takes(r.task_row())]
    return rows if limit is None else rows[:limit]


def greedy_answers(payload: Any, model: Any, engine: Any, tokenizer: Any,
                   prompts: list[tuple[str, list[int], Any]], max_new_tokens: int = 12,
                   zero_features: bool = False) -> list[str]:
    """Greedy answers to ``(row_id, prompt token ids, cached features)`` from ``engine``, prompts built through
    ``payload`` (the encoder's rollout payload) and ``model``'s projector."""
    return sampled_answers(payload, model, engine, tokenizer, prompts, max_new_tokens, zero_features=zero_features)


def sampled_answers(payload: Any, model: Any, engine: Any, tokenizer: Any,
                    prompts: list[tuple[str, list[int], Any]], max_new_tokens: int = 12, temperature: float = 0.0,
                    seed: int = 0, zero_features: bool = False) -> list[str]:
    """One answer per prompt: greedy at ``temperature`` 0, else sampled at it from the engine's per-prompt
    generators seeded from ``seed`` (the same seed gives the same answers)."""
    embeds = prompt_embeddings(payload, model, prompts, zero_features=zero_features)
    greedy = temperature == 0
    completions = engine.generate(embeds, 1, max_new_tokens, temperature=1.0 if greedy else temperature,
                                  greedy=greedy, seed=None if greedy else seed)
    return [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]


def generate_answers(session: Any, model: Any, rows: list[Any], max_new_tokens: int = 12,
                     zero_features: bool = False, temperature: float = 0.0, seed: int = 0) -> list[str]:
    """Answers of ``model`` to ``rows`` (their cached features; ``zero_features``: zeroed, a control), greedy
    unless ``temperature`` > 0."""
    prompts = [(row.id, session.prompt_ids(row.prompt_messages, row.num_items), session.data.features(row))
               for row in rows]
    engine = EmbeddedEngine(model.lm, pad_id=session.pad_id, eos_id=session.tokenizer.eos_token_id,
                            suppress_ids=list(session.sentinel_ids.as_dict().values()))
    return sampled_answers(payload_for(session.registry, session.encoder_spec), model, engine, session.tokenizer,
                           prompts, max_new_tokens, temperature, seed, zero_features)


def evaluate_rows(session: Any, model: Any, rows: list[Any], task: TaskSpec, batch_size: int = 16,
                  zero_features: bool = False, max_new_tokens: int = 12, temperature: float = 0.0,
                  seed: int = 0) -> list[dict[str, Any]]:
    """One record per row: id, question, expected, answer and the task's score of the answer."""
    was_training = model.training
    model.eval()
    out = []
    try:
        for i in range(0, len(rows), batch_size):
            chunk = rows[i : i + batch_size]
            texts = generate_answers(session, model, chunk, max_new_tokens, zero_features, temperature, seed + i)
            for row, text in zip(chunk, texts, strict=True):
                out.append({"id": row.id, "question": row.question, "expected": row.answer, "answer": text,
                            "score": task.score(text, row.task_row())})
    finally:
        model.train(was_training)
    return out


def evaluate_accuracy(session: Any, model: Any, partition: str, limit: int = 64, batch_size: int = 16,
                      zero_features: bool = False, max_new_tokens: int = 12, temperature: float = 0.0,
                      seed: int = 0) -> float:
    """Mean task score of the answers (greedy at ``temperature`` 0, at most ``max_new_tokens``) on the first
    ``limit`` gradable rows of ``partition``."""
    task = recipe_task(session)
    rows = graded_rows(session, partition, task, limit)
    if not rows:
        raise ValueError(f"partition {partition!r} has no rows that task {task.name!r} can grade "
                         f"(TaskSpec.accepts refused every row)")
    records = evaluate_rows(session, model, rows, task, batch_size, zero_features, max_new_tokens, temperature,
                            seed)
    return sum(r["score"] for r in records) / len(records)


def partition_baseline(session: Any, partition: str, limit: int | None = None) -> dict[str, Any]:
    """The majority-answer baseline on ``partition``'s gradable rows (the same rows evaluation grades)."""
    task = recipe_task(session)
    return majority_baseline(task, [r.task_row() for r in graded_rows(session, partition, task, limit)])
