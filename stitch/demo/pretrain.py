"""Pre-training a tiny base LM on task-style chat text, so a demo preset is a small *trained* LM.

A random frozen LM caps what LoRA + projector can learn (its tied output layer keeps logits near zero). A real
LM arrives knowing how to count the items of a list; the tiny base is taught the same in text: its media block
is filled with one word per image cell (``.`` for an empty cell, a colour word for an object, in reading order)
and the answer counts the colour words. Stitching then only has to present each image patch as such a word.

The build is deterministic: one intra-op thread and deterministic kernels, so every build writes the same
bytes (``tests/demo/test_demo_base.py`` builds twice).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stitch.data.collator import IGNORE_INDEX, tokenize_example
from stitch.data.sentinels import SentinelIds
from stitch.demo.tiny import CAPTION_QUESTION, COLORS, COUNT_QUESTION, MAX_OBJECTS, SHAPES, SIZES, answer_text

EMPTY_CELL = "."


def single_token(tokenizer: Any, text: str) -> int:
    """The id of ``text`` when it is exactly one token; a pre-training cell must be one position."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"demo pre-training: {text!r} is {len(ids)} tokens in this tokenizer, expected 1")
    return ids[0]


def caption(colors: list[str], rng: random.Random) -> str:
    """A caption in the demo data's format (``stitch.demo.data.caption_text``): count first, then the objects."""
    n = len(colors)
    head = "There is 1 object" if n == 1 else f"There are {n} objects"
    phrases = [f"a {rng.choice(SIZES)} {c} {rng.choice(SHAPES)}" for c in colors]
    listed = phrases[0] if n == 1 else ", ".join(phrases[:-1]) + " and " + phrases[-1]
    return f"{head}: {listed}."


def task_examples(tokenizer: Any, sentinels: tuple[str, str, str], tokens_per_item: int, n: int,
                  seed: int = 0) -> Iterator[tuple[list[int], list[int]]]:
    """``(input_ids, labels)`` of chat rows whose media block spells the scene as words, one per cell.

    Labels cover the text (question and answer); the cells are masked: which cell holds an object is random,
    so predicting them teaches nothing.
    """
    start, placeholder, end = tokenizer.convert_tokens_to_ids(list(sentinels))
    ids = SentinelIds(start, placeholder, end)
    empty = single_token(tokenizer, EMPTY_CELL)
    color_ids = {c: single_token(tokenizer, " " + c) for c in COLORS}
    rng = random.Random(seed)
    for _ in range(n):
        k = rng.randint(1, MAX_OBJECTS)
        cells = sorted(rng.sample(range(tokens_per_item), k))
        colors = [rng.choice(COLORS) for _ in cells]
        if rng.random() < 0.8:
            question, answer = COUNT_QUESTION, answer_text(k)
        else:
            question, answer = CAPTION_QUESTION, caption(colors, rng)
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        input_ids, _ = tokenize_example(tokenizer, messages, ids, tokens_per_item, 1)
        first = input_ids.index(placeholder)
        block = [empty] * tokens_per_item
        for cell, color in zip(cells, colors, strict=True):
            block[cell] = color_ids[color]
        input_ids[first : first + tokens_per_item] = block
        labels = list(input_ids)
        labels[first - 1 : first + tokens_per_item + 1] = [IGNORE_INDEX] * (tokens_per_item + 2)
        yield input_ids, labels


@contextlib.contextmanager
def deterministic_cpu() -> Iterator[None]:
    """One intra-op thread and deterministic kernels for the block; the caller's settings come back after."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def pretrain_in_place(model_dir: Path, sentinels: tuple[str, str, str], *, steps: int = 300, batch_size: int = 32,
                      lr: float = 3e-3, tokens_per_item: int = 49, seed: int = 0) -> None:
    """Load the snapshot in ``model_dir``, train all parameters on task text, save it back (safetensors)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with deterministic_cpu():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, use_safetensors=True)
        examples = task_examples(tokenizer, sentinels, tokens_per_item, steps * batch_size, seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)
        model.train()
        for _ in range(steps):
            batch = [next(examples) for _ in range(batch_size)]
            width = max(len(ids) for ids, _ in batch)
            input_ids = torch.full((batch_size, width), tokenizer.pad_token_id)
            labels = torch.full((batch_size, width), IGNORE_INDEX)
            mask = torch.zeros((batch_size, width), dtype=torch.long)
            for i, (ids, lab) in enumerate(batch):
                input_ids[i, : len(ids)], labels[i, : len(lab)], mask[i, : len(ids)] = (
                    torch.tensor(ids), torch.tensor(lab), 1)
            loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
        model.eval()
    model.save_pretrained(model_dir, safe_serialization=True)
