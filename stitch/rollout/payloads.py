"""Rollout payloads for cached-feature modalities: one declared field carrying [items, tokens, width]."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from stitch.plugins.specs import RolloutPayloadSpec


class PayloadError(ValueError):
    pass


def feature_payload_spec(name: str, modality: str, tokens_per_item: int, feature_width: int) -> RolloutPayloadSpec:
    """A payload whose single field ``name`` holds cached encoder features for one row.

    ``build(row_id, features, projector)`` validates the features and returns
    ``{"row_id", name: features, "soft_tokens": projector(features) as [items * tokens, hidden]}``;
    the rollout engine splices ``soft_tokens`` into the prompt's text embeddings at the placeholders.
    """

    def validate(payload: Mapping[str, Any]) -> None:
        row = payload.get("row_id", "?")
        if name not in payload:
            raise PayloadError(f"row {row}: payload has no field {name!r}; fields: {sorted(payload)}")
        feats = payload[name]
        if not isinstance(feats, torch.Tensor):
            raise PayloadError(f"row {row}: field {name!r} must be a tensor, got {type(feats).__name__}")
        if feats.dim() != 3 or tuple(feats.shape[1:]) != (tokens_per_item, feature_width):
            raise PayloadError(
                f"row {row}: field {name!r} has shape {tuple(feats.shape)}; "
                f"expected [items, {tokens_per_item}, {feature_width}]"
            )
        if not torch.isfinite(feats).all():
            raise PayloadError(f"row {row}: field {name!r} holds non-finite values")

    def build(row_id: str, features: torch.Tensor, projector: torch.nn.Module) -> dict[str, Any]:
        payload: dict[str, Any] = {"row_id": row_id, name: features}
        validate(payload)
        param = next(projector.parameters())
        soft = projector(features.to(device=param.device, dtype=param.dtype))
        payload["soft_tokens"] = soft.reshape(-1, soft.shape[-1])
        return payload

    return RolloutPayloadSpec(
        name=name,
        modality=modality,
        fields=(name,),
        build=build,
        validate=validate,
        description=f"{modality} features [items, {tokens_per_item}, {feature_width}] -> projected soft tokens",
    )
