"""Text from data is text: a question or answer that spells a sentinel or a chat-template control token is
tokenized as ordinary text, so it never becomes a placeholder, a media bracket or an end-of-turn."""

from __future__ import annotations

import pytest

from stitch.data.collator import prompt_token_ids, tokenize_example
from stitch.data.sentinels import resolve_sentinels
from stitch.host.host import load_plugins
from stitch.model.loading import load_tokenizer

FAMILIES = {"qwen3.5": "qwen3.5-demo", "nemotron-h": "nemotron-nano-tiny"}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    host = load_plugins()
    spec = host.get("models", FAMILIES[request.param])
    tokenizer = load_tokenizer(spec)
    sentinel_spec = host.get("token_sentinels", spec.sentinels)
    return tokenizer, sentinel_spec, resolve_sentinels(sentinel_spec, tokenizer)


def _hostile(tokenizer, sentinel_spec) -> str:
    controls = [t for t in tokenizer.all_special_tokens if t not in sentinel_spec.tokens]
    return " ".join([*sentinel_spec.tokens, *controls, sentinel_spec.placeholder * 3])


def test_every_sentinel_and_special_token_in_question_and_answer_stays_text(family):
    tokenizer, sentinel_spec, ids = family
    text = _hostile(tokenizer, sentinel_spec)
    messages = [{"role": "user", "content": f"What is {text}?"}, {"role": "assistant", "content": f"It is {text}."}]
    input_ids, labels = tokenize_example(tokenizer, messages, ids, tokens_per_item=7, num_items=1, row_id="r1")
    assert input_ids.count(ids.start) == 1 and input_ids.count(ids.end) == 1
    assert input_ids.count(ids.placeholder) == 7
    answer = [t for t, label in zip(input_ids, labels, strict=True) if label != -100]
    assert answer[-1] == tokenizer.eos_token_id and tokenizer.eos_token_id not in answer[:-1]
    assert tokenizer.decode(answer[:-1]) == f"It is {text}."
    assert not set(answer[:-1]) & set(tokenizer.all_special_ids)


def test_a_prompt_spelling_a_sentinel_has_the_same_media_block_as_a_plain_one(family):
    tokenizer, sentinel_spec, ids = family
    plain = prompt_token_ids(tokenizer, "How many?", ids, 5, 2)
    spelled = prompt_token_ids(tokenizer, f"How many{sentinel_spec.start}?", ids, 5, 2)
    for token in (ids.start, ids.placeholder, ids.end):
        assert spelled.count(token) == plain.count(token)
    assert len(spelled) > len(plain)
