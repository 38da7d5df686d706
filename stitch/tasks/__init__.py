"""Tasks: what a dataset is trained and judged on (GRPO reward, evaluation grader, DPO pairs).

A recipe names a registered task (``task: counting``) or gives its reward as ``module:function`` or
``path/to/rewards.py:function`` (relative to the recipe file); ``resolve_task`` turns that into the ``TaskSpec``
the stages call, and ``check_task`` refuses a task that cannot work before any data or weights are touched.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from stitch.config.recipe import Recipe
from stitch.plugins.registry import Registry
from stitch.plugins.specs import TaskRow, TaskSpec

DEFAULT_TASK = "exact-match"


class TaskError(ValueError):
    """The recipe's task cannot be resolved; the message names the field, the module or file and the function."""


def _task_fields(recipe: Recipe) -> tuple[str | None, str | None, str | None]:
    """(name, reward, grade) from ``recipe.task``: None, a name, a mapping or a TaskConfig-like object."""
    task = getattr(recipe, "task", None)
    if task is None:
        return DEFAULT_TASK, None, None
    if isinstance(task, str):
        return task, None, None
    get = task.get if isinstance(task, Mapping) else lambda key: getattr(task, key, None)
    return get("name"), get("reward"), get("grade")


def _where(recipe: Recipe) -> str:
    path = getattr(recipe, "path", None)
    return f"recipe {str(path) if path else getattr(recipe, 'name', '?')!r}"


def resolve_task(recipe: Recipe, registry: Registry) -> TaskSpec:
    """The TaskSpec of ``recipe.task`` (default ``exact-match``): a task registered in ``registry``,
    or a task whose reward (and optional grader) are user functions ``(completion: str, row: TaskRow) -> float``.
    """
    name, reward, grade = _task_fields(recipe)
    if reward is None:
        try:
            return registry.get("tasks", name)
        except KeyError as exc:  # the registry's lookup error: it lists the registered tasks
            raise TaskError(f"{_where(recipe)}: field 'task': {exc}") from exc
    reward_fn = load_function(reward, "task.reward", recipe)
    grade_fn = load_function(grade, "task.grade", recipe) if grade else None
    return TaskSpec(name=reward, reward=reward_fn, grade=grade_fn,
                    description=f"reward {reward}" + (f", graded by {grade}" if grade else "")
                    + "; DPO pairs from the dataset's rejected column")


def scorer_name(recipe: Recipe, task: TaskSpec) -> str:
    """What evaluation's scores come from, in words: the grader when there is one, else the reward."""
    name, reward, grade = _task_fields(recipe)
    if reward is None:
        return f"the {'grader' if task.grade is not None else 'reward'} of task {task.name!r}"
    return f"grader {grade}" if grade else f"reward {reward} (no grader given)"


def check_task(recipe: Recipe, registry: Registry) -> TaskSpec:
    """``resolve_task`` at load time, plus the contracts the recipe's stages need from the task: DPO needs
    pairs, either from the task's generator or from the dataset's ``rejected`` column."""
    task = resolve_task(recipe, registry)
    stages = getattr(recipe, "stages", {}) or {}
    columns = getattr(getattr(recipe, "data", None), "columns", None)
    if "dpo" in stages and task.rejected is None and getattr(columns, "rejected", None) is None:
        raise TaskError(
            f"{_where(recipe)}: stage 'dpo' needs preference pairs, but task {task.name!r} has no rejected-answer "
            f"generator and field 'data.columns.rejected' is not set; name the dataset column holding a "
            f"dispreferred answer per row, or use a task that generates one"
        )
    return task


def load_function(target: str, field: str, recipe: Recipe | None = None) -> Callable[[str, TaskRow], float]:
    """The function named by ``module:function`` or ``path/to/file.py:function`` (a relative file is found
    from the recipe's directory); refused naming ``field``, the module or file and the function."""
    where = (f"{_where(recipe)}: " if recipe is not None else "") + f"field {field!r} = {target!r}"
    module_part, sep, attr = target.rpartition(":")
    if not sep or not module_part or not attr:
        raise TaskError(f"{where}: expected 'module:function' or 'path/to/file.py:function', got {target!r}")
    if module_part.endswith(".py") or "/" in module_part or "\\" in module_part:
        module, origin = _module_from_file(module_part, where, recipe), f"file {module_part!r}"
    else:
        origin = f"module {module_part!r}"
        try:
            module = importlib.import_module(module_part)
        except Exception as exc:  # an import error of any kind inside the user's module is theirs to see
            raise TaskError(
                f"{where}: cannot import {origin} for function {attr!r} ({type(exc).__name__}: {exc}); expected an "
                f"importable module, or a file written as 'path/to/file.py:{attr}' relative to the recipe's directory"
            ) from exc
    fn = getattr(module, attr, None)
    if fn is None:
        raise TaskError(f"{where}: {origin} has no function {attr!r}")
    if not callable(fn):
        raise TaskError(f"{where}: {attr!r} in {origin} is not callable (a {type(fn).__name__}); expected a function "
                        f"(completion: str, row: TaskRow) -> float")
    try:
        inspect.signature(fn).bind("completion", TaskRow("row", "question", "answer"))
    except TypeError as exc:
        raise TaskError(f"{where}: {attr!r} in {origin} cannot be called as (completion, row) ({exc}); expected "
                        f"a function (completion: str, row: TaskRow) -> float") from exc
    except ValueError:  # builtins without a signature: trust them
        pass
    return fn


def _module_from_file(spec_path: str, where: str, recipe: Recipe | None) -> Any:
    path = Path(spec_path).expanduser()
    if not path.is_absolute():
        recipe_path = getattr(recipe, "path", None)
        base = Path(recipe_path).parent if recipe_path else Path.cwd()
        path = base / path
    path = path.resolve()
    if not path.is_file():
        raise TaskError(f"{where}: file {str(path)!r} does not exist (from {spec_path!r}, relative to the recipe's "
                        f"directory)")
    # one module per file path, so a task resolved twice (validation, then the stage) shares one module
    name = "stitch_user_task_" + hashlib.sha256(str(path).encode()).hexdigest()[:16]
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) == str(path):
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise TaskError(f"{where}: file {str(path)!r} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise TaskError(f"{where}: importing file {str(path)!r} failed ({type(exc).__name__}: {exc})") from exc
    return module


def majority_baseline(task: TaskSpec, rows: list[TaskRow]) -> dict[str, Any]:
    """The score of always answering the most frequent recorded answer among ``rows`` (graded by ``task``):
    the accuracy a model reaches without looking at the input."""
    if not rows:
        return {"answer": None, "accuracy": None, "rows": 0}
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.answer] = counts.get(row.answer, 0) + 1
    answer = max(counts, key=counts.__getitem__)  # ties: the first seen
    accuracy = sum(task.score(answer, row) for row in rows) / len(rows)
    return {"answer": answer, "accuracy": accuracy, "rows": len(rows)}


__all__ = ["DEFAULT_TASK", "TaskError", "check_task", "load_function", "majority_baseline", "resolve_task"]
