"""The one map of a run directory: prepared data, the resolved recipe, and per stage its checkpoints, metrics and
summary. Stages, distributed saving, the chain and inference read paths here instead of re-deriving them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunLayout:
    """``OUT/data/{manifest.jsonl, feature-cache/}``, ``OUT/recipe.yaml``, ``OUT/<stage>/{checkpoints/, metrics.jsonl,
    summary.json}``."""

    out_dir: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "out_dir", Path(self.out_dir))

    @property
    def data_dir(self) -> Path:
        return self.out_dir / "data"

    @property
    def manifest(self) -> Path:
        return self.data_dir / "manifest.jsonl"

    @property
    def recipe(self) -> Path:
        """The resolved recipe this run trained with (written by each stage's setup)."""
        return self.out_dir / "recipe.yaml"

    @property
    def run_summary(self) -> Path:
        return self.out_dir / "summary.json"

    def stage_dir(self, stage: str) -> Path:
        return self.out_dir / stage

    def checkpoints(self, stage: str) -> Path:
        """``<stage>/checkpoints``: ``step_N/`` directories and ``LATEST``; also a later stage's warm-start source."""
        return self.stage_dir(stage) / "checkpoints"

    def metrics(self, stage: str) -> Path:
        return self.stage_dir(stage) / "metrics.jsonl"

    def completions(self, stage: str) -> Path:
        """``<stage>/completions.jsonl``: GRPO's sampled completions with their rewards, every ``log_every`` steps."""
        return self.stage_dir(stage) / "completions.jsonl"

    def summary(self, stage: str) -> Path:
        return self.stage_dir(stage) / "summary.json"
