"""One dataset's part of a preparation (its config, row checks, manifest lines and counts), and the decoders of
every dataset behind the one pool of decode workers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stitch.config.data import DataConfig
from stitch.data.feature_cache import ManifestLines
from stitch.data.rows import PromptCheck, RowDecoder
from stitch.kernels.shared_slots import SharedSlots


def recipe_section(name: str, named: bool) -> str:
    """The recipe section that configures dataset ``name``: ``datasets.<name>``, or ``data`` for a single source."""
    return f"datasets.{name}" if named else "data"


@dataclass
class DatasetScan:
    """One dataset's part of a preparation: its complete config, row checks, manifest lines and counts."""

    name: str
    index: int  # its place in the recipe: which ``DatasetDecoders`` decoder its rows' jobs name
    data: DataConfig
    prompts: PromptCheck
    decoder: RowDecoder
    lines: ManifestLines
    named: bool  # the recipe declares ``datasets``: row ids and errors carry the dataset's name
    rows_scanned: int = 0
    rows_unassigned: int = 0
    skipped: list[dict[str, Any]] = field(default_factory=list)
    items: int = 0  # media references of its written rows
    items_shared: int = 0  # of them, those whose features an earlier row already had

    @property
    def section(self) -> str:
        """The recipe section an error's hint names this dataset's options under (``recipe_section``)."""
        return recipe_section(self.name, self.named)

    @property
    def where(self) -> str:
        """How an error names this dataset: its field path under ``datasets``, nothing for a single source."""
        return f"{self.section}: " if self.named else ""

    def report(self, rows_written: Mapping[str, int]) -> dict[str, Any]:
        rows = {p.name: rows_written[p.name] for p in self.data.partitions or ()}
        return {"source": self.data.source.describe() if self.data.source else None, "rows": rows,
                "rows_scanned": self.rows_scanned, "rows_unassigned": self.rows_unassigned,
                "skipped": len(self.skipped), "items": self.items, "items_shared": self.items_shared}


@dataclass(frozen=True)
class DatasetDecoders:
    """The ``RowDecoder`` of each dataset of one preparation behind one worker pool (forked once, before the run's
    threads): a chunk's jobs come from one dataset, whose index leads each job."""

    decoders: tuple[RowDecoder, ...]

    def rows(self, chunk: list[tuple[Any, ...]], slots: SharedSlots | None = None,
             slot: int | None = None) -> tuple[list[Any], list[Any], Any, tuple[float, float]]:
        """``RowDecoder.rows`` of the chunk's dataset on its jobs."""
        return self.decoders[chunk[0][0]].rows([job[1:] for job in chunk], slots, slot)
