"""Prompt rendering, the collator and the soft-token scatter, on real BPE tokenizers of two families."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stitch.data.collator import Collator, CollatorError, prompt_token_ids, render_prompt, tokenize_example
from stitch.data.sentinels import resolve_sentinels
from stitch.demo.tiny import CAPTION_QUESTION, COLORS, COUNT_QUESTION, SHAPES, answer_text, chatml_template
from stitch.model.scatter import PlaceholderCountError, scatter_soft_tokens
from stitch.plugins.specs import SentinelSpec

# two tokenizer families with different sentinel strings, as the Qwen and Nemotron plugins have
QWEN_LIKE = SentinelSpec("qwen-like", "<|vision_start|>", "<|vision_pad|>", "<|vision_end|>")
NEMOTRON_LIKE = SentinelSpec("nemotron-like", "<SPECIAL_100>", "<SPECIAL_101>", "<SPECIAL_102>")


def _tokenizer(tmp_path_factory, sentinels: SentinelSpec, pad: str, eos: str):
    from transformers import AutoTokenizer

    from stitch.demo.tiny import train_tokenizer

    out = tmp_path_factory.mktemp(sentinels.name)
    train_tokenizer(out, (pad, "<|im_start|>", eos, *sentinels.tokens), eos_token=eos, pad_token=pad,
                    chat_template=chatml_template("<|im_start|>", eos))
    return AutoTokenizer.from_pretrained(out)


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory):
    return _tokenizer(tmp_path_factory, QWEN_LIKE, "<|endoftext|>", "<|im_end|>")


@pytest.fixture(scope="module")
def nemotron_tok(tmp_path_factory):
    return _tokenizer(tmp_path_factory, NEMOTRON_LIKE, "<unk>", "</s>")


def conversation(question: str, answer: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def test_rendered_prompt_opens_the_user_turn_with_one_media_block_per_item(qwen_tok):
    text = render_prompt(qwen_tok, COUNT_QUESTION, QWEN_LIKE, tokens_per_item=3, num_items=2)
    block = "<|vision_start|>" + "<|vision_pad|>" * 3 + "<|vision_end|>"
    assert text == f"<|im_start|>user\n{block}{block}\n{COUNT_QUESTION}<|im_end|>\n<|im_start|>assistant\n"


def test_training_sample_starts_with_exactly_the_rollout_prompt_tokens(qwen_tok):
    ids = resolve_sentinels(QWEN_LIKE, qwen_tok)
    prompt = prompt_token_ids(qwen_tok, COUNT_QUESTION, ids, 49, 1)
    input_ids, labels = tokenize_example(qwen_tok, conversation(COUNT_QUESTION, answer_text(3)), ids, 49, 1)
    assert input_ids[: len(prompt)] == prompt
    assert qwen_tok.decode(input_ids[: len(prompt)]) == render_prompt(qwen_tok, COUNT_QUESTION, QWEN_LIKE, 49, 1)
    answer = qwen_tok(answer_text(3), add_special_tokens=False)["input_ids"] + [qwen_tok.eos_token_id]
    assert input_ids[len(prompt):] == answer
    assert labels == [-100] * len(prompt) + answer


def test_sentinel_ids_and_spec_render_the_same_prompt(qwen_tok):
    ids = resolve_sentinels(QWEN_LIKE, qwen_tok)
    assert render_prompt(qwen_tok, CAPTION_QUESTION, ids, 5, 1) == render_prompt(qwen_tok, CAPTION_QUESTION, QWEN_LIKE, 5, 1)


def test_same_cached_features_collate_with_each_familys_own_sentinels(qwen_tok, nemotron_tok):
    row = {"id": "r0", "messages": conversation(COUNT_QUESTION, answer_text(2)), "features": torch.randn(1, 4, 8)}
    for tok, spec in ((qwen_tok, QWEN_LIKE), (nemotron_tok, NEMOTRON_LIKE)):
        ids = resolve_sentinels(spec, tok)
        batch = Collator(tok, spec, tokens_per_item=4, feature_width=8)([row])
        assert int((batch.input_ids == ids.placeholder).sum()) == 4
        assert int((batch.input_ids == ids.start).sum()) == 1 and int((batch.input_ids == ids.end).sum()) == 1
        assert torch.equal(batch.features, row["features"])


def test_sentinel_typed_into_the_question_stays_text_and_adds_no_placeholder(qwen_tok):
    messages = conversation(f"{COUNT_QUESTION} <|vision_pad|>", answer_text(1))
    ids, _ = tokenize_example(qwen_tok, messages, QWEN_LIKE, 1, 1, row_id="row-9")
    placeholder = qwen_tok.convert_tokens_to_ids("<|vision_pad|>")
    assert ids.count(placeholder) == 1  # the media block's own, not the one the question spells


def test_collator_refuses_features_of_the_wrong_width_or_token_count_naming_the_row(qwen_tok):
    collate = Collator(qwen_tok, QWEN_LIKE, tokens_per_item=4, feature_width=8)
    for shape in ((1, 4, 7), (1, 5, 8)):
        row = {"id": "bad-row", "messages": conversation(COUNT_QUESTION, "x"), "features": torch.zeros(shape)}
        with pytest.raises(CollatorError, match=r"row 'bad-row': features have shape .*expected \[items, 4, 8\]"):
            collate([row])


def test_collator_refuses_a_row_longer_than_max_length_instead_of_truncating(qwen_tok):
    collate = Collator(qwen_tok, QWEN_LIKE, tokens_per_item=49, feature_width=8, max_length=40)
    row = {"id": "long", "messages": conversation(COUNT_QUESTION, "x"), "features": torch.zeros(1, 49, 8)}
    with pytest.raises(CollatorError, match=r"row 'long' is \d+ tokens, over max_length=40"):
        collate([row])


def test_scatter_placeholder_count_mismatch_names_the_row_expected_and_actual():
    input_ids = torch.tensor([[1, 9, 9, 2], [1, 9, 2, 0]])  # row b has one placeholder, needs two
    embeds = torch.zeros(2, 4, 3)
    soft = torch.ones(2, 2, 3)
    with pytest.raises(PlaceholderCountError) as err:
        scatter_soft_tokens(embeds, input_ids, soft, 9, row_ids=["a", "b"], items_per_row=[1, 1])
    message = str(err.value)
    assert "row 'b': expected 2 placeholders (1 items x 2), found 1" in message and "row 'a'" not in message
    with pytest.raises(PlaceholderCountError, match=r"expected 4, actual 3\); rows in this batch: a, b"):
        scatter_soft_tokens(embeds, input_ids, soft, 9, row_ids=["a", "b"])


def test_scatter_refuses_soft_tokens_of_a_different_hidden_width():
    with pytest.raises(ValueError, match="width 5 but the LM's embeddings have 3"):
        scatter_soft_tokens(torch.zeros(1, 2, 3), torch.tensor([[9, 9]]), torch.zeros(2, 5), 9)


def test_scatter_is_out_of_place_and_gradients_reach_embeddings_and_soft_tokens():
    input_ids = torch.tensor([[1, 9, 9, 2]])
    embeds = torch.randn(1, 4, 3, requires_grad=True)
    soft = torch.randn(1, 2, 3, requires_grad=True)
    before = embeds.detach().clone()
    out = scatter_soft_tokens(embeds, input_ids, soft, 9)
    (out * torch.arange(1.0, 13.0).reshape(1, 4, 3)).sum().backward()
    assert torch.equal(embeds.detach(), before)
    assert torch.equal(soft.grad, torch.arange(4.0, 10.0).reshape(1, 2, 3))
    assert torch.equal(embeds.grad[0, 1:3], torch.zeros(2, 3))
    assert torch.equal(embeds.grad[0, 0], torch.tensor([1.0, 2.0, 3.0]))


# -- properties ------------------------------------------------------------------------------------------

words = st.sampled_from(
    [*COLORS, *SHAPES, "How", "many", "objects", "are", "in", "the", "image?", "Describe", "There", "is", "a", "and"]
)
text = st.lists(words, min_size=1, max_size=8).map(" ".join)
row_strategy = st.tuples(text, text, st.integers(min_value=0, max_value=3))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(row_strategy, min_size=1, max_size=4), tokens=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_soft_tokens_land_exactly_at_placeholders_and_nothing_else_changes(qwen_tok, rows, tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    width, hidden = 5, 7
    ids = resolve_sentinels(QWEN_LIKE, qwen_tok)
    examples = [
        {"id": f"r{i}", "messages": conversation(q, a), "features": torch.randn(n, tokens, width, generator=gen)}
        for i, (q, a, n) in enumerate(rows)
    ]
    batch = Collator(qwen_tok, ids, tokens_per_item=tokens, feature_width=width)(examples)
    n_items = sum(n for _, _, n in rows)
    assert batch.features.shape == (n_items, tokens, width)
    assert batch.row_ids == [e["id"] for e in examples]

    embeds = torch.randn(*batch.input_ids.shape, hidden, generator=gen)
    soft = torch.randn(n_items, tokens, hidden, generator=gen)
    out = scatter_soft_tokens(embeds, batch.input_ids, soft, ids.placeholder, row_ids=batch.row_ids,
                              items_per_row=[n for _, _, n in rows])
    mask = batch.input_ids == ids.placeholder
    assert torch.equal(out[mask], soft.reshape(-1, hidden))  # in order, row by row
    assert torch.equal(out[~mask], embeds[~mask])  # every other embedding untouched

    for b, (question, answer, n) in enumerate(rows):
        length = int(batch.attention_mask[b].sum())
        row_ids = batch.input_ids[b, :length].tolist()
        prompt = prompt_token_ids(qwen_tok, question, ids, tokens, n)
        assert row_ids[: len(prompt)] == prompt  # byte-identical to the rollout prompt
        labelled = batch.labels[b] != -100
        target = qwen_tok(answer, add_special_tokens=False)["input_ids"] + [qwen_tok.eos_token_id]
        assert batch.labels[b, labelled].tolist() == target  # loss only on the answer and EOS
        assert labelled.nonzero().flatten().tolist() == list(range(len(prompt), length))
        assert not labelled[mask[b]].any()
        assert batch.position_ids[b, :length].tolist() == list(range(length))
        assert batch.attention_mask[b, length:].sum() == 0 and (batch.labels[b, length:] == -100).all()


@settings(max_examples=30, deadline=None)
@given(
    counts=st.lists(st.integers(0, 3), min_size=1, max_size=4),
    tokens=st.integers(1, 5),
    delta=st.sampled_from([-1, 1]),
    victim=st.integers(0, 3),
)
def test_scatter_refuses_any_per_row_placeholder_miscount_and_names_that_row(counts, tokens, delta, victim):
    victim %= len(counts)
    if counts[victim] == 0 and delta < 0:
        delta = 1
    length = 2 + tokens * (max(counts) + 1)
    input_ids = torch.zeros(len(counts), length, dtype=torch.long)
    for b, n in enumerate(counts):
        placeholders = n * tokens + (delta if b == victim else 0)
        input_ids[b, 1 : 1 + placeholders] = 9
    soft = torch.zeros(sum(counts), tokens, 4)
    names = [f"row-{b}" for b in range(len(counts))]
    with pytest.raises(PlaceholderCountError) as err:
        scatter_soft_tokens(torch.zeros(len(counts), length, 4), input_ids, soft, 9, row_ids=names,
                            items_per_row=counts)
    assert f"row 'row-{victim}'" in str(err.value)
    assert all(f"row '{n}'" not in str(err.value) for i, n in enumerate(names) if i != victim)
