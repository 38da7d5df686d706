"""Prompt embeddings for engines, built through the registered rollout payload of the recipe's encoder.

Every path that hands a prompt to an engine (GRPO rollouts, evaluation, inference, serving) goes through
``prompt_embeddings``: the payload spec builds the row's payload from its cached features (projecting them to
soft tokens), the core checks the declared fields are there and runs the payload's validator, and only then
are the soft tokens spliced into the prompt's text embeddings. Engines receive nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from stitch.data.collator import piece_mark, tokenize_marked
from stitch.data.sentinels import SentinelIds
from stitch.model.scatter import scatter_soft_tokens
from stitch.plugins.registry import Registry
from stitch.plugins.specs import EncoderSpec, RolloutPayloadSpec
from stitch.rollout.payloads import PayloadError


def payload_for(registry: Registry, encoder: EncoderSpec) -> RolloutPayloadSpec:
    """The rollout payload ``encoder`` names (``EncoderSpec.payload``), looked up in ``registry``; an
    encoder that names none, or a payload of another modality, is refused naming both."""
    if not encoder.payload:
        raise LookupError(
            f"encoder {encoder.name!r} names no rollout payload (EncoderSpec.payload), so its features cannot "
            f"reach a rollout engine (GRPO, evaluation, inference): register a RolloutPayloadSpec "
            f"(stitch.api.feature_payload_spec builds one for cached features) and name it in the EncoderSpec"
        )
    payload = registry.get("rollout_payloads", encoder.payload)
    if payload.modality != encoder.modality:
        raise LookupError(f"encoder {encoder.name!r} (modality {encoder.modality!r}) names the rollout payload "
                          f"{payload.name!r}, which carries modality {payload.modality!r}")
    return payload


class MediaSlot:
    """Where one media item stands in a message's content (``MEDIA``)."""

    def __repr__(self) -> str:
        return "MEDIA"


MEDIA = MediaSlot()
Content = str | Sequence[str | MediaSlot]


def _joined(content: Content, mark: Any) -> str:
    """One message's content with every piece marked: a newline between a text piece and its neighbours, media
    items of one run adjacent (so ``[MEDIA, MEDIA, text]`` renders as ``prompt_token_ids`` renders two items)."""
    pieces = [content] if isinstance(content, str) else list(content)
    out, previous = [], None
    for piece in pieces:
        media = isinstance(piece, MediaSlot)
        if previous is not None and not (media and previous):
            out.append("\n")
        out.append(mark(piece))
        previous = media
    return "".join(out)


def conversation_prompt_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]], sentinels: SentinelIds,
                            tokens_per_item: int) -> list[int]:
    """A whole conversation's prompt ids, each media item's sentinel block where its ``MEDIA`` slot stands: the
    chat template's markup tokenized as usual, message text tokenized with ``split_special_tokens`` (as
    ``stitch.data.collator.prompt_token_ids`` does; a one-turn ``[MEDIA x k, question]`` gives its exact ids for
    ``k`` items). Serving renders multi-turn, several-media chats here."""
    block = [sentinels.start, *[sentinels.placeholder] * tokens_per_item, sentinels.end]
    pieces: list[list[int] | str] = []

    def mark(piece: str | MediaSlot) -> str:
        pieces.append(block if isinstance(piece, MediaSlot) else piece)
        return piece_mark(len(pieces) - 1)

    marked = [{"role": m["role"], "content": _joined(m["content"], mark)} for m in messages]
    return tokenize_marked(tokenizer, marked, pieces)[0]


def build_payload(payload: RolloutPayloadSpec, row_id: str, features: torch.Tensor,
                  projector: torch.nn.Module) -> dict[str, Any]:
    """One row's payload, built by the spec and validated: every declared field present, the spec's validator
    passed, ``soft_tokens`` a ``[n, hidden]`` tensor. Raises ``PayloadError`` naming the row otherwise."""
    built = payload.build(row_id, features, projector)
    missing = [name for name in payload.fields if name not in built]
    if missing:
        raise PayloadError(f"row {row_id}: rollout payload {payload.name!r} built no field(s) {missing}; it declares "
                           f"{list(payload.fields)}")
    payload.validate(built)
    soft = built.get("soft_tokens")
    if not isinstance(soft, torch.Tensor) or soft.dim() != 2:
        shape = tuple(soft.shape) if isinstance(soft, torch.Tensor) else type(soft).__name__
        raise PayloadError(f"row {row_id}: rollout payload {payload.name!r} built soft_tokens {shape}; expected a "
                           f"[tokens, hidden] tensor")
    return built


def prompt_embeddings(payload: RolloutPayloadSpec, model: Any, prompts: Sequence[tuple[str, list[int], torch.Tensor]],
                      zero_features: bool = False) -> list[torch.Tensor]:
    """``[prompt_len, hidden]`` embeddings, one per ``(row_id, token_ids, features)``: text embeddings with the
    payload's projected soft tokens at the placeholders (``zero_features``: the features zeroed, a control).

    ``model`` is a ``StitchedModel`` (``lm``, ``projector``, ``placeholder_id``, ``device``). Call it under
    ``torch.no_grad()`` for rollouts; the result is on the model's device in the LM's embedding dtype.
    """
    out = []
    device = model.device
    embed_tokens = model.lm.get_input_embeddings()
    for row_id, ids, features in prompts:
        feats = torch.zeros_like(features) if zero_features else features
        built = build_payload(payload, row_id, feats, model.projector)
        input_ids = torch.tensor([ids], device=device)
        embeds = embed_tokens(input_ids)
        soft = built["soft_tokens"].to(device=embeds.device, dtype=embeds.dtype)
        out.append(scatter_soft_tokens(embeds, input_ids, soft, model.placeholder_id, row_ids=[row_id])[0])
    return out
