"""Held-out evaluation: greedy answers from prompt embeddings, graded by the first integer after
"The answer is"."""

from __future__ import annotations

import re
from typing import Any

import torch

ANSWER = re.compile(r"answer is\s*(-?\d+)", re.IGNORECASE)


def parse_answer(text: str) -> int | None:
    """The first integer after "The answer is", or None."""
    match = ANSWER.search(text)
    return int(match.group(1)) if match else None


def prompt_embeds_batch(session: Any, model: Any, rows: list[Any], zero_features: bool = False):
    """Left-padded prompt embeddings (soft tokens spliced in) and the attention mask for ``rows``."""
    embeds, lengths = [], []
    for row in rows:
        ids = torch.tensor([session.prompt_ids(row.question, row.num_items)], device=session.device)
        feats = session.data.features(row)
        if zero_features:
            feats = torch.zeros_like(feats)
        embeds.append(model.embed(ids, feats.to(session.device), [row.id])[0])
        lengths.append(ids.shape[1])
    width = max(lengths)
    hidden = embeds[0].shape[-1]
    pad = model.lm.get_input_embeddings()(torch.tensor([session.pad_id], device=session.device))[0]
    batch = pad.expand(len(rows), width, hidden).clone()
    mask = torch.zeros(len(rows), width, dtype=torch.long, device=session.device)
    for i, (emb, n) in enumerate(zip(embeds, lengths, strict=True)):
        batch[i, width - n :] = emb
        mask[i, width - n :] = 1
    return batch, mask


@torch.no_grad()
def generate_answers(session: Any, model: Any, rows: list[Any], max_new_tokens: int = 12,
                     zero_features: bool = False) -> list[str]:
    embeds, mask = prompt_embeds_batch(session, model, rows, zero_features)
    out = model.lm.generate(
        inputs_embeds=embeds,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=session.pad_id,
        eos_token_id=session.tokenizer.eos_token_id,
        suppress_tokens=list(session.sentinel_ids.as_dict().values()),
    )
    return session.tokenizer.batch_decode(out, skip_special_tokens=True)


def evaluate_accuracy(session: Any, model: Any, partition: str, limit: int = 64, batch_size: int = 16,
                      zero_features: bool = False) -> float:
    """Fraction of ``partition``'s counting rows answered with the recorded number."""
    rows = [r for r in session.data.rows(partition) if parse_answer(r.answer) is not None][:limit]
    if not rows:
        raise ValueError(f"partition {partition!r} has no rows with a numeric answer to grade")
    was_training = model.training
    model.eval()
    correct = 0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i : i + batch_size]
        for row, text in zip(chunk, generate_answers(session, model, chunk, zero_features=zero_features),
                             strict=True):
            correct += parse_answer(text) == parse_answer(row.answer)
    model.train(was_training)
    return correct / len(rows)
