"""Scattering soft tokens into the LM's input embeddings at the placeholder positions, out of place."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class PlaceholderCountError(ValueError):
    """The number of placeholder tokens differs from the number of soft tokens supplied."""


def scatter_soft_tokens(
    inputs_embeds: torch.Tensor,
    input_ids: torch.Tensor,
    soft_tokens: torch.Tensor,
    placeholder_id: int,
    *,
    row_ids: Sequence[str] | None = None,
    items_per_row: Sequence[int] | None = None,
    positions: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """A copy of ``inputs_embeds [B, T, H]`` whose placeholder positions hold ``soft_tokens`` in order.

    ``soft_tokens`` is ``[items, tokens, H]`` or ``[items * tokens, H]``, ordered as the placeholders appear
    (row-major over ``input_ids``). ``items_per_row`` (one count per batch row) lets a count mismatch name
    the exact rows at fault; otherwise the error names every row in ``row_ids``. Gradients flow to both
    ``inputs_embeds`` and ``soft_tokens``.

    ``positions``: the placeholders' flat positions over ``[B * T]`` (on the embeddings' device) and their count,
    found on the host before the batch moved; then neither the count check nor the scatter reads the device.
    """
    hidden = inputs_embeds.shape[-1]
    if soft_tokens.shape[-1] != hidden:
        raise ValueError(
            f"soft tokens have width {soft_tokens.shape[-1]} but the LM's embeddings have {hidden}; "
            f"the projector was built for a different base model"
        )
    flat = soft_tokens.reshape(-1, hidden)
    if positions is not None and positions[1] == flat.shape[0]:
        if positions[1] == 0:
            return inputs_embeds
        out = inputs_embeds.reshape(-1, hidden).index_copy(0, positions[0], flat.to(inputs_embeds.dtype))
        return out.reshape(inputs_embeds.shape)
    mask = input_ids == placeholder_id  # also when the host count disagrees: the error below names the rows
    found = int(mask.sum())
    if found != flat.shape[0]:
        raise PlaceholderCountError(_count_message(mask, soft_tokens, found, flat.shape[0], row_ids, items_per_row))
    if found == 0:
        return inputs_embeds
    return inputs_embeds.masked_scatter(mask.unsqueeze(-1), flat.to(inputs_embeds.dtype))


def _count_message(
    mask: torch.Tensor,
    soft_tokens: torch.Tensor,
    found: int,
    supplied: int,
    row_ids: Sequence[str] | None,
    items_per_row: Sequence[int] | None,
) -> str:
    ids = list(row_ids) if row_ids is not None else [f"batch row {i}" for i in range(mask.shape[0])]
    head = f"placeholder count {found} in input_ids does not match {supplied} soft tokens"
    if items_per_row is not None and soft_tokens.dim() == 3 and len(items_per_row) == mask.shape[0]:
        tokens = soft_tokens.shape[1]
        per_row = mask.sum(dim=1).tolist()
        bad = [
            f"row {ids[i] if i < len(ids) else i!r}: expected {n * tokens} placeholders ({n} items x {tokens}), "
            f"found {per_row[i]}"
            for i, n in enumerate(items_per_row)
            if per_row[i] != n * tokens
        ]
        if bad:
            return f"{head}; " + "; ".join(bad)
    return f"{head} (expected {supplied}, actual {found}); rows in this batch: {', '.join(map(str, ids))}"
