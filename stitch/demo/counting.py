"""The counting demo's task: the answer is the first integer after "The answer is"."""

from __future__ import annotations

import re
from typing import Any

from stitch.plugins.specs import TaskRow, TaskSpec

ANSWER = re.compile(r"answer is\s*(-?\d+)", re.IGNORECASE)


def parse_answer(text: str) -> int | None:
    """The first integer after "The answer is", or None."""
    match = ANSWER.search(text)
    return int(match.group(1)) if match else None


def answer_text(count: int) -> str:
    return f"The answer is {count}."


def counting_reward(completion: str, row: TaskRow) -> float:
    """1.0 when the first integer after "The answer is" equals the recorded one, else 0.0."""
    got, want = parse_answer(completion), parse_answer(row.answer)
    return float(got is not None and got == want)


def counting_rejected(row: TaskRow, rng: Any) -> str | None:
    """DPO's rejected answer: the next integer."""
    n = parse_answer(row.answer)
    return None if n is None else answer_text(n + 1)


COUNTING = TaskSpec(
    name="counting",
    reward=counting_reward,
    accepts=lambda row: parse_answer(row.answer) is not None,
    rejected=counting_rejected,
    description='first integer after "The answer is" equals the recorded count; DPO rejects the next integer',
)
