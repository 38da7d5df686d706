"""The colour-naming demo task: "The answer is red.", graded by normalised exact match of the whole answer;
DPO's rejected answer is the same sentence with another colour of the palette."""

from __future__ import annotations

import re
from typing import Any

from stitch.demo.tiny import COLORS
from stitch.plugins.specs import TaskRow, TaskSpec
from stitch.tasks.generic import exact_match

_COLOR_WORD = re.compile(r"\b(" + "|".join(COLORS) + r")\b", re.IGNORECASE)


def named_colors(text: str) -> list[str]:
    """The palette colours named in ``text``, in order."""
    return [m.group(1).lower() for m in _COLOR_WORD.finditer(text)]


def names_a_color(row: TaskRow) -> bool:
    """Whether the row asks for a colour and its recorded answer names exactly one (caption rows do not ask)."""
    return row.question.lower().startswith("what color") and len(named_colors(row.answer)) == 1


def wrong_color(row: TaskRow, rng: Any) -> str | None:
    """DPO's rejected answer: the recorded answer with its colour swapped for another, drawn with ``rng``."""
    named = named_colors(row.answer)
    if len(named) != 1:
        return None
    other = rng.choice([c for c in COLORS if c != named[0]])
    return _COLOR_WORD.sub(other, row.answer, count=1)


COLOR_NAMING = TaskSpec(
    name="color-naming",
    reward=exact_match,
    accepts=names_a_color,
    rejected=wrong_color,
    description="name the colour of the shape (\"The answer is red.\"): normalised exact match; DPO rejects the "
                "same answer with another palette colour",
)
