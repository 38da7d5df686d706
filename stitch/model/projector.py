"""Projectors: the small trainable map from encoder features to the LM's hidden width (soft tokens)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from stitch.plugins.specs import ProjectorSpec


class FeatureWidthError(ValueError):
    """Features do not have the width the projector was built for."""


class MLP2xGeluProjector(nn.Sequential):
    """LLaVA's ``mlp2x_gelu``: Linear(feature -> hidden), GELU, Linear(hidden -> hidden); keys ``0.*``, ``2.*``."""

    def __init__(self, feature_width: int, hidden_size: int) -> None:
        super().__init__(nn.Linear(feature_width, hidden_size), nn.GELU(), nn.Linear(hidden_size, hidden_size))
        self.feature_width = feature_width
        self.hidden_size = hidden_size


class LinearProjector(nn.Linear):
    """One Linear(feature -> hidden); keys ``weight``, ``bias``."""

    def __init__(self, feature_width: int, hidden_size: int) -> None:
        super().__init__(feature_width, hidden_size)
        self.feature_width = feature_width
        self.hidden_size = hidden_size


PROJECTORS = (
    ProjectorSpec("mlp2x_gelu", MLP2xGeluProjector, "Linear -> GELU -> Linear (LLaVA-1.5; the default)"),
    ProjectorSpec("linear", LinearProjector, "a single Linear layer (LLaVA-1.0)"),
)


def projector_input_width(projector: nn.Module) -> int:
    """The feature width a projector accepts: its ``feature_width``, else its first Linear's input."""
    width = getattr(projector, "feature_width", None)
    if isinstance(width, int):
        return width
    for module in projector.modules():
        if isinstance(module, nn.Linear):
            return module.in_features
    raise TypeError(f"cannot tell the input width of projector {type(projector).__name__}")


def check_feature_width(projector: nn.Module, features: torch.Tensor, row_ids: Sequence[str] = ()) -> None:
    """Refuse features whose last dimension is not the projector's input width, naming the rows."""
    expected = projector_input_width(projector)
    actual = features.shape[-1] if features.dim() else None
    if actual != expected:
        rows = ", ".join(map(str, row_ids)) or "?"
        raise FeatureWidthError(
            f"rows [{rows}]: feature width {actual} does not match the projector's input width {expected} "
            f"(features {tuple(features.shape)}); were they prepared with a different encoder?"
        )
