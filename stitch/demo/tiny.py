"""Tiny presets' shared parts: a BPE tokenizer trained here on task-style text, and its chat template."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

COLORS = ("red", "green", "blue", "yellow", "purple", "cyan")
SHAPES = ("circle", "square", "triangle")
SIZES = ("small", "large")
COUNT_QUESTION = "How many objects are in the image?"
CAPTION_QUESTION = "Describe the image."
MAX_OBJECTS = 8  # the counting demo's scenes hold 1..MAX_OBJECTS objects
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def answer_text(count: int) -> str:
    return f"The answer is {count}."


def task_corpus(n: int = 4000, seed: int = 0) -> list[str]:
    """Sentences in the demo task's vocabulary: questions, answers, captions, numbers."""
    rng = random.Random(seed)
    lines = [COUNT_QUESTION, CAPTION_QUESTION, "You are a helpful assistant."]
    for _ in range(n):
        k = rng.randint(0, 9)
        color, shape, size = rng.choice(COLORS), rng.choice(SHAPES), rng.choice(SIZES)
        plural = shape + ("s" if k != 1 else "")
        lines.append(answer_text(k))
        lines.append(f"There are {k} objects. A {size} {color} {shape} and {NUMBER_WORDS[k]} {plural}.")
        lines.append(f"{k} + {rng.randint(0, 9)} = ? {COUNT_QUESTION} The image shows {k} {plural}.")
    return lines


def chatml_template(start: str = "<|im_start|>", end: str = "<|im_end|>") -> str:
    """A ChatML-style Jinja template with the given role markers."""
    return (
        "{% for message in messages %}"
        f"{start}{{{{ message['role'] }}}}\n{{{{ message['content'] }}}}{end}\n"
        "{% endfor %}"
        f"{{% if add_generation_prompt %}}{start}assistant\n{{% endif %}}"
    )


def train_tokenizer(
    out_dir: Path,
    special_tokens: Sequence[str],
    *,
    eos_token: str,
    pad_token: str,
    chat_template: str,
    vocab_size: int = 512,
    corpus: Iterable[str] | None = None,
    bos_token: str | None = None,
    extra_config: dict | None = None,
    appended_tokens: Sequence[str] = (),
) -> None:
    """Train a byte-level BPE on ``corpus`` and save it as a ``PreTrainedTokenizerFast`` in ``out_dir``.

    ``appended_tokens``: special tokens added after training, so their ids follow the whole trained vocabulary: a
    preset that gains a control token (a video's brackets) keeps every id it had, and with them its trained weights."""
    from tokenizers import (  # deferred: plugin loading skips transformers
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast  # deferred: plugin loading skips transformers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus if corpus is not None else task_corpus()), trainer=trainer)
    tok.add_special_tokens(list(appended_tokens))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos_token,
        pad_token=pad_token,
        bos_token=bos_token,
        additional_special_tokens=[t for t in (*special_tokens, *appended_tokens)
                                   if t not in {eos_token, pad_token, bos_token}],
    )
    fast.chat_template = chat_template
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    if extra_config:
        cfg_path = out_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.update(extra_config)
        cfg_path.write_text(json.dumps(cfg, indent=2))


def padded_vocab_size(tokenizer_dir: Path, multiple: int = 64) -> int:
    """The embedding rows for a tokenizer: its length read back, rounded up (as real checkpoints do)."""
    from transformers import AutoTokenizer  # deferred: plugin loading skips transformers

    n = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    return -(-n // multiple) * multiple
