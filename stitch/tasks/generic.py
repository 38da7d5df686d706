"""Tasks the core registers for any dataset with free-text answers: normalised exact match and containment.

Both take DPO pairs from the dataset's ``rejected`` column (``data.columns.rejected``): a generic task cannot
invent a plausible wrong answer for arbitrary text, so it leaves ``TaskSpec.rejected`` unset.
"""

from __future__ import annotations

import re
import unicodedata

from stitch.plugins.specs import TaskRow, TaskSpec

_SPACE = re.compile(r"\s+")
# what a sentence may end with that does not change the answer: "Red." == "red"
_TRAILING = ".,;:!?\"'`)]}…。"
_LEADING = "\"'`([{"


def normalise_answer(text: str) -> str:
    """Case-folded, whitespace collapsed, surrounding quotes/brackets and trailing punctuation stripped."""
    text = unicodedata.normalize("NFKC", text).casefold()
    text = _SPACE.sub(" ", text).strip()
    previous = None
    while previous != text:
        previous = text
        text = text.rstrip(_TRAILING).lstrip(_LEADING).strip()
    return text


def exact_match(completion: str, row: TaskRow) -> float:
    """1.0 when the completion equals the recorded answer after ``normalise_answer``, else 0.0."""
    want = normalise_answer(row.answer)
    return float(bool(want) and normalise_answer(completion) == want)


def contains_answer(completion: str, row: TaskRow) -> float:
    """1.0 when the normalised answer appears in the normalised completion as whole words, else 0.0."""
    want = normalise_answer(row.answer)
    if not want:
        return 0.0
    pattern = r"(?<!\w)" + re.escape(want) + r"(?!\w)"
    return float(re.search(pattern, normalise_answer(completion)) is not None)


def has_answer(row: TaskRow) -> bool:
    return bool(normalise_answer(row.answer))


EXACT_MATCH = TaskSpec(
    name="exact-match",
    reward=exact_match,
    accepts=has_answer,
    description="completion equals the answer after normalising case, whitespace, quotes and trailing "
                "punctuation; DPO pairs from the dataset's rejected column",
)

CONTAINS = TaskSpec(
    name="contains",
    reward=contains_answer,
    accepts=has_answer,
    description="the normalised answer appears in the completion as whole words (a completion listing every "
                "candidate also scores: prefer exact-match for RL); DPO pairs from the rejected column",
)
