"""A stage's view of one run: the recipe, the run layout, the model binding and the prepared data, resolved
before any model weights load. Text, model and artifact work is the binding's (stitch.model.binding); paths are
the layout's (stitch.runs.layout); this class only joins them and turns manifest rows into samples."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stitch.config.recipe import Recipe
from stitch.data.collator import Messages, TrainTurns, tokenize_example
from stitch.data.feature_cache import ManifestRow, PreparedData
from stitch.data.packing import Sample
from stitch.model.binding import ModelBinding
from stitch.plugins.registry import Registry
from stitch.runs.layout import RunLayout


@dataclass
class StitchSession:
    recipe: Recipe
    layout: RunLayout
    binding: ModelBinding
    data: PreparedData

    @classmethod
    def open(cls, recipe: Recipe, out_dir: Path, registry: Registry, dtype: torch.dtype = torch.float32,
             device: str | None = None) -> StitchSession:
        """Resolve the recipe's registrations in ``registry`` and the prepared data before any model weights
        load."""
        layout = RunLayout(out_dir)
        binding = ModelBinding.for_recipe(recipe, registry, dtype=dtype, device=device)
        if not layout.manifest.is_file():
            raise FileNotFoundError(
                f"{layout.manifest} does not exist: run `stitch prepare --recipe {recipe.name} "
                f"--out {layout.data_dir}` first"
            )
        return cls(recipe, layout, binding, PreparedData(layout.data_dir))

    # what evaluation and the stages read often, named once here
    @property
    def registry(self) -> Registry:
        return self.binding.registry

    @property
    def model_spec(self) -> Any:
        return self.binding.model_spec

    @property
    def encoder_spec(self) -> Any:
        return self.binding.encoder_spec

    @property
    def tokenizer(self) -> Any:
        return self.binding.tokenizer

    @property
    def sentinel_ids(self) -> Any:
        return self.binding.sentinel_ids

    @property
    def device(self) -> torch.device:
        return self.binding.device

    @property
    def pad_id(self) -> int:
        return self.binding.pad_id

    @property
    def out_dir(self) -> Path:
        return self.layout.out_dir

    @property
    def manifest_path(self) -> Path:
        return self.data.manifest_path

    def prompt_ids(self, question: str | Messages, num_items: int = 1) -> list[int]:
        return self.binding.prompt_ids(question, num_items)

    def make_sample(self, record: dict[str, Any], turns: TrainTurns = "last") -> Sample:
        """A manifest record as a training sample: the chat tokenized with its placeholders, and its features;
        ``turns`` says which assistant turns carry labels (``tokenize_example``)."""
        row = ManifestRow.from_json(record, str(self.manifest_path))
        input_ids, labels = tokenize_example(
            self.tokenizer, row.messages, self.sentinel_ids, self.encoder_spec.tokens_per_item, row.num_items,
            row_id=row.id, turns=turns,
        )
        return Sample(row.id, input_ids, labels, self.data.features(row))
