"""The one table of stages, in chain order: name -> options class, stage class, warm-start source and the parts
it hands over, whether the stage runs data parallel under torchrun. The CLI, the chain and validation read it.

The options classes stay in ``stitch.config.options.STAGE_OPTIONS`` (the config layer imports no stage code);
this table takes them from there and must name the same stages in the same order.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from stitch.config.options import STAGE_OPTIONS, StageOptions


@dataclass(frozen=True)
class StageEntry:
    name: str
    runner: str  # "module:Class" of the stage's ``stitch.stages.loop.Stage`` (imported when the stage runs)
    warm_start: str | None = None  # the stage whose latest checkpoint this one starts from
    warm_parts: tuple[str, ...] = ()  # what it takes from there: "projector", "adapter"
    data_parallel: bool = False  # runs FSDP2 data parallel under torchrun

    @property
    def options(self) -> type[StageOptions]:
        return STAGE_OPTIONS[self.name]

    def stage_class(self) -> type:
        module, _, cls = self.runner.partition(":")
        return getattr(importlib.import_module(module), cls)


STAGES: dict[str, StageEntry] = {
    entry.name: entry
    for entry in (
        StageEntry("alignment", "stitch.stages.supervised:AlignmentStage", data_parallel=True),
        StageEntry("sft", "stitch.stages.supervised:SFTStage", warm_start="alignment", warm_parts=("projector",),
                   data_parallel=True),
        StageEntry("grpo", "stitch.stages.grpo:GRPOStage", warm_start="sft", warm_parts=("adapter", "projector")),
        StageEntry("dpo", "stitch.stages.dpo:DPOStage", warm_start="sft", warm_parts=("adapter", "projector")),
    )
}

if list(STAGES) != list(STAGE_OPTIONS):
    raise RuntimeError(f"stitch.stages.registry.STAGES {list(STAGES)} and stitch.config.options.STAGE_OPTIONS "
                       f"{list(STAGE_OPTIONS)} must name the same stages in the same order")
