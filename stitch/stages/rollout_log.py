"""What GRPO sampled, made visible: ``completions.jsonl`` (one row per sampled completion every ``log_every``
steps, bounded in rows and text), the end-of-run completion table, and the "no learning signal" watch that warns
once when every group scored alike for several consecutive steps."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stitch.runs.atomic import write_text_atomic

log = logging.getLogger("stitch")

MAX_ROWS_PER_STEP = 64  # a logged step keeps its first completions: the file grows by at most this many rows
MAX_TEXT_CHARS = 500  # a completion's text is cut here (its token count is kept whole)
SUMMARY_ROWS = 8  # completions shown in the end-of-run table: the last logged step's first ones


@dataclass(frozen=True)
class CompletionRecord:
    """One sampled completion: which prompt, what it said, how long, how it scored, whether it hit the cap."""

    step: int
    prompt_id: str
    group: int
    completion: str
    tokens: int
    rewards: dict[str, float]
    advantage: float
    hit_max_new_tokens: bool


def hit_length_cap(token_ids: Sequence[int], max_new_tokens: int, eos_id: int | None) -> bool:
    """Whether a completion was cut by ``max_new_tokens`` rather than ended by the model (EOS)."""
    return len(token_ids) >= max_new_tokens and (not token_ids or token_ids[-1] != eos_id)


def flat_groups(rewards: Sequence[float], group_size: int) -> bool:
    """Whether every group's completions scored exactly alike: all advantages are zero, so the step learns
    nothing from the reward."""
    groups = [rewards[i:i + group_size] for i in range(0, len(rewards), group_size)]
    return all(max(g) == min(g) for g in groups)


class CompletionLog:
    """``completions.jsonl`` beside the stage's metrics: rows of every ``every``-th step (0: none), at most
    ``MAX_ROWS_PER_STEP`` per step, texts cut at ``MAX_TEXT_CHARS``; a resumed run drops rows past its step."""

    def __init__(self, path: Path, every: int) -> None:
        self.path, self.every = Path(path), every

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def write(self, records: Sequence[CompletionRecord]) -> None:
        rows = [{**asdict(r), "completion": r.completion[:MAX_TEXT_CHARS]} for r in records[:MAX_ROWS_PER_STEP]]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as fh:
            fh.write("".join(json.dumps(row) + "\n" for row in rows))

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line]

    def truncate_after(self, step: int) -> None:
        if self.path.exists():
            write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in self.read() if r["step"] <= step))

    def reset(self) -> None:
        self.path.unlink(missing_ok=True)

    def last_step_table(self) -> list[dict[str, Any]]:
        """The end-of-run table: the first ``SUMMARY_ROWS`` completions of the last logged step."""
        rows = self.read()
        last = rows[-1]["step"] if rows else None
        return [r for r in rows if r["step"] == last][:SUMMARY_ROWS]


class SignalWatch:
    """Counts consecutive steps whose groups all scored alike and warns once when they reach ``patience``."""

    def __init__(self, patience: int, log_path: Path) -> None:
        self.patience, self.log_path = patience, log_path
        self.flat_steps, self.longest, self.warned = 0, 0, False

    def observe(self, step: int, flat: bool, capped_share: float) -> bool:
        """Record one step; returns whether this call warned."""
        self.flat_steps = self.flat_steps + 1 if flat else 0
        self.longest = max(self.longest, self.flat_steps)
        if self.warned or self.patience <= 0 or self.flat_steps < self.patience:
            return False
        self.warned = True
        log.warning(
            "grpo step %d: no learning signal: all completions scored alike in every group for %d consecutive "
            "step(s) (loss and gradients carry only the KL term); %.0f%% of this step's completions hit "
            "max_new_tokens; see %s", step, self.flat_steps, 100 * capped_share, self.log_path)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"flat_steps": self.flat_steps, "longest": self.longest, "warned": self.warned}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.flat_steps, self.longest = state.get("flat_steps", 0), state.get("longest", 0)
        self.warned = state.get("warned", False)
