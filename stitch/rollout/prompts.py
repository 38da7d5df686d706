"""Prompt embeddings for engines, built through the registered rollout payload of the recipe's encoder.

Every path that hands a prompt to an engine (GRPO rollouts, evaluation, inference, serving) goes through
``prompt_embeddings``: the payload spec validates the row's cached features and projects them to soft
tokens before anything reaches an engine; the soft tokens are spliced into the prompt's text embeddings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from stitch.model.scatter import scatter_soft_tokens
from stitch.plugins.specs import EncoderSpec, RolloutPayloadSpec


def payload_for(host: Any, encoder: EncoderSpec) -> RolloutPayloadSpec:
    """The rollout payload registered for ``encoder``'s modality and shape (``EncoderSpec.payload`` names it
    when set); a miss names the encoder and the payloads available."""
    name = getattr(encoder, "payload", None)
    if name:
        return host.get("rollout_payloads", name)
    matches = [reg.spec for reg in host.registrations("rollout_payloads") if reg.spec.modality == encoder.modality]
    if len(matches) == 1:
        return matches[0]
    available = ", ".join(f"{r.name} ({r.spec.modality})" for r in host.registrations("rollout_payloads")) or "none"
    raise LookupError(
        f"encoder {encoder.name!r} (modality {encoder.modality!r}) has {len(matches)} matching rollout payloads; "
        f"set EncoderSpec.payload to one name. Registered: {available}"
    )


def prompt_embeddings(payload: RolloutPayloadSpec, model: Any, prompts: Sequence[tuple[str, list[int], torch.Tensor]],
                      zero_features: bool = False) -> list[torch.Tensor]:
    """``[prompt_len, hidden]`` embeddings, one per ``(row_id, token_ids, features)``: text embeddings with the
    payload's projected soft tokens at the placeholders (``zero_features``: the features zeroed, a control)."""
    out = []
    device = model.device
    for row_id, ids, features in prompts:
        feats = torch.zeros_like(features) if zero_features else features
        built = payload.build(row_id, feats, model.projector)
        payload.validate({k: v for k, v in built.items() if k != "soft_tokens"})
        input_ids = torch.tensor([ids], device=device)
        embeds = model.lm.get_input_embeddings()(input_ids)
        soft = built["soft_tokens"].to(device=embeds.device, dtype=embeds.dtype)
        out.append(scatter_soft_tokens(embeds, input_ids, soft, model.placeholder_id, row_ids=[row_id])[0])
    return out
