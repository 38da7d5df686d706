"""Pre-training a tiny base LM on task-style chat text, so a demo preset is a small *trained* LM.

A random frozen LM caps what LoRA + projector can learn (its tied output layer keeps logits near zero);
a few hundred full-parameter steps on text in the task's format make the tiny chain learn in minutes.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from stitch.demo.tiny import CAPTION_QUESTION, COLORS, COUNT_QUESTION, SHAPES, answer_text


def task_conversations(tokenizer: Any, sentinels: tuple[str, str, str], tokens_per_item: int, n: int,
                       seed: int = 0) -> list[str]:
    """Chat-rendered rows in the task's format (media markers included, answers random)."""
    rng = random.Random(seed)
    start, placeholder, end = sentinels
    media = start + placeholder * tokens_per_item + end
    texts = []
    for _ in range(n):
        k = rng.randint(1, 5)
        if rng.random() < 0.8:
            question, answer = COUNT_QUESTION, answer_text(k)
        else:
            question = CAPTION_QUESTION
            answer = f"There are {k} objects: a {rng.choice(COLORS)} {rng.choice(SHAPES)} and more."
        messages = [{"role": "user", "content": media + question}, {"role": "assistant", "content": answer}]
        texts.append(tokenizer.apply_chat_template(messages, tokenize=False))
    return texts


def pretrain_in_place(model_dir: Path, sentinels: tuple[str, str, str], *, steps: int = 300, batch_size: int = 32,
                      lr: float = 3e-3, tokens_per_item: int = 49, seed: int = 0) -> None:
    """Load the snapshot in ``model_dir``, train all parameters on task text, save it back (safetensors)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, use_safetensors=True)
    texts = task_conversations(tokenizer, sentinels, tokens_per_item, steps * batch_size, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    for step in range(steps):
        enc = tokenizer(texts[step * batch_size : (step + 1) * batch_size], return_tensors="pt", padding=True,
                        add_special_tokens=False)
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        loss = model(**enc, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    model.eval()
    model.save_pretrained(model_dir, safe_serialization=True)
