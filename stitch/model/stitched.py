"""The trainable composite: a base LM (optionally with a LoRA adapter) plus a projector whose soft tokens
are scattered into the LM's input embeddings at placeholder positions."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stitch.model.scatter import scatter_soft_tokens


class StitchedModel(nn.Module):
    def __init__(self, lm: nn.Module, projector: nn.Module, placeholder_id: int) -> None:
        super().__init__()
        self.lm = lm
        self.projector = projector
        self.placeholder_id = placeholder_id

    @property
    def device(self) -> torch.device:
        return next(self.projector.parameters()).device

    def embed(self, input_ids: torch.Tensor, features: torch.Tensor, row_ids: list[str] | None = None) -> torch.Tensor:
        """Text embeddings with each placeholder replaced by the projector's soft tokens, in order."""
        embeds = self.lm.get_input_embeddings()(input_ids)
        if features.numel() == 0:
            return embeds
        soft = self.projector(features.to(device=embeds.device, dtype=next(self.projector.parameters()).dtype))
        return scatter_soft_tokens(
            embeds, input_ids, soft.reshape(-1, soft.shape[-1]).to(embeds.dtype), self.placeholder_id,
            row_ids=row_ids,
        )

    def forward(self, batch: Any) -> torch.Tensor:
        return self.logits(batch)

    def logits(self, batch: Any) -> torch.Tensor:
        embeds = self.embed(batch.input_ids, batch.features, batch.row_ids)
        out = self.lm(
            inputs_embeds=embeds,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
        )
        return out.logits

    def loss(self, batch: Any) -> tuple[torch.Tensor, int]:
        """Mean next-token cross-entropy over labelled tokens; returns (loss, labelled token count)."""
        logits = self.logits(batch)[:, :-1].float()
        target = batch.labels[:, 1:]
        n = int((target != -100).sum())
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100, reduction="sum"
        )
        return loss / max(n, 1), n
