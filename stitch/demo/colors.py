"""The colour-naming demo task: the answer is a bare colour word ("red"), graded by normalised exact match;
DPO's rejected answer is another colour of the palette."""

from __future__ import annotations

from typing import Any

from stitch.demo.tiny import COLORS
from stitch.plugins.specs import TaskRow, TaskSpec
from stitch.tasks.generic import exact_match, normalise_answer


def names_a_color(row: TaskRow) -> bool:
    """Whether the row's recorded answer is one palette colour (caption rows are not)."""
    return normalise_answer(row.answer) in COLORS


def wrong_color(row: TaskRow, rng: Any) -> str | None:
    """DPO's rejected answer: a different palette colour, drawn with the stage's ``rng``."""
    right = normalise_answer(row.answer)
    if right not in COLORS:
        return None
    return rng.choice([c for c in COLORS if c != right])


COLOR_NAMING = TaskSpec(
    name="color-naming",
    reward=exact_match,
    accepts=names_a_color,
    rejected=wrong_color,
    description="name the colour of the shape: normalised exact match on the colour word; DPO rejects another "
                "palette colour",
)
