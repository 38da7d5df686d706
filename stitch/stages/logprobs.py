"""Log-probabilities of label tokens under the live policy, or under frozen reference weights substituted into
it at call time (GRPO's old/reference scores and KL, DPO's reference)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.func import functional_call

from stitch.kernels.cross_entropy import logprobs_from_logits


def logits_with(model: Any, params: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
    """Logits with ``params`` (e.g. the reference adapter and projector) substituted for the live ones."""
    return functional_call(model, params, (batch,), strict=False)


def token_logprobs(model: Any, batch: Any, temperature: float = 1.0, params: dict[str, torch.Tensor] | None = None,
                   suppress_ids: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each next label token, mask of label positions) under ``model`` (or ``params`` substituted
    into it), over the distribution an engine samples from (``suppress_ids`` masked, ``temperature`` applied).
    Only positions under the mask carry a log-prob."""
    if hasattr(model, "token_logprobs"):  # StitchedModel: the head on labelled positions only, in chunks
        if params is None:
            return model.token_logprobs(batch, temperature, suppress_ids)
        return functional_call(model, params, (batch,), {"logprobs": (temperature, suppress_ids)}, strict=False)
    logits = model.logits(batch) if params is None else logits_with(model, params, batch)
    return logprobs_from_logits(logits, batch.labels, temperature, suppress_ids)


def sequence_logprob(model: Any, batch: Any, params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Summed log-prob of each row's label tokens."""
    lp, mask = token_logprobs(model, batch, params=params)
    return (lp * mask).sum(1)
