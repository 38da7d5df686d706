"""Tasks: what a dataset is trained and judged on (GRPO reward, evaluation grader, DPO pairs).

A recipe names its task (``task: counting``) or gives a reward as ``module:function``; ``resolve_task`` turns
that into the ``TaskSpec`` the stages call. Registered tasks come from ``register_tasks``.
"""

from __future__ import annotations

from typing import Any

from stitch.plugins.specs import TaskSpec


def resolve_task(recipe: Any, host: Any = None) -> TaskSpec:
    """The TaskSpec the recipe names (default: ``counting``, the demo's task, until recipes declare one)."""
    if host is None:
        from stitch.plugins.host import get_host

        host = get_host()
    name = getattr(recipe, "task", None) or "counting"
    return host.get("tasks", name if isinstance(name, str) else name.name)
