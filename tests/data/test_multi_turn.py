"""Multi-turn conversations and interleaved images: per-turn loss masks, media blocks where the markers stand."""

from __future__ import annotations

import pytest
import torch

from stitch.data.collator import (
    IGNORE_INDEX,
    CollatorError,
    prompt_token_ids,
    render_prompt,
    tokenize_example,
)
from stitch.data.sentinels import resolve_sentinels
from stitch.plugins.specs import SentinelSpec

QWEN_LIKE = SentinelSpec("qwen-like", "<|vision_start|>", "<|vision_pad|>", "<|vision_end|>")
TOKENS = 3


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from stitch.demo.tiny import chatml_template, train_tokenizer

    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(out, ("<|endoftext|>", "<|im_start|>", "<|im_end|>", *QWEN_LIKE.tokens), eos_token="<|im_end|>",
                    pad_token="<|endoftext|>", chat_template=chatml_template("<|im_start|>", "<|im_end|>"))
    return AutoTokenizer.from_pretrained(out)


def three_turns(middle: str = "The left one has two circles.") -> list[dict[str, str]]:
    """A three-turn row whose two images stand where its markers are."""
    return [
        {"role": "user", "content": "Compare <image> and <image>. How many circles are on the left?"},
        {"role": "assistant", "content": middle},
        {"role": "user", "content": "And how many objects in total?"},
        {"role": "assistant", "content": "The answer is 5."},
    ]


def _bigram_loss(model: torch.nn.Module, ids: list[int], labels: list[int]) -> torch.Tensor:
    logits = model(torch.tensor(ids[:-1]))
    return torch.nn.functional.cross_entropy(logits, torch.tensor(labels[1:]), ignore_index=IGNORE_INDEX,
                                             reduction="sum")


def test_changing_a_non_final_assistant_turn_changes_the_loss_only_when_every_turn_trains(tok):
    """A bigram LM (each token predicts the next, no wider context) isolates the labels: the final answer's loss
    does not depend on the earlier turn, so only the earlier turn's own labels can move the loss."""
    ids = resolve_sentinels(QWEN_LIKE, tok)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(len(tok), 16), torch.nn.Linear(16, len(tok)))
    losses = {}
    for turns in ("all", "last"):
        for middle in ("The left one has two circles.", "Three squares sit on the left."):
            row = tokenize_example(tok, three_turns(middle), ids, TOKENS, 2, turns=turns)
            with torch.no_grad():
                losses[turns, middle] = float(_bigram_loss(model, *row))
    a, b = "The left one has two circles.", "Three squares sit on the left."
    assert losses["all", a] != losses["all", b]
    assert losses["last", a] == losses["last", b]


def test_every_turn_labels_each_assistant_text_and_its_end_of_turn_token(tok):
    ids = resolve_sentinels(QWEN_LIKE, tok)
    input_ids, labels = tokenize_example(tok, three_turns(), ids, TOKENS, 2, turns="all")
    _, last_only = tokenize_example(tok, three_turns(), ids, TOKENS, 2, turns="last")
    learned = [i for i, label in zip(input_ids, labels, strict=True) if label != IGNORE_INDEX]
    middle = tok("The left one has two circles.", add_special_tokens=False)["input_ids"]
    final = tok("The answer is 5.", add_special_tokens=False)["input_ids"]
    assert learned == middle + [tok.eos_token_id] + final + [tok.eos_token_id]
    assert [i for i, label in zip(input_ids, last_only, strict=True) if label != IGNORE_INDEX] == [
        *final, tok.eos_token_id]


def test_each_media_block_stands_where_its_marker_is(tok):
    text = render_prompt(tok, three_turns()[:3], QWEN_LIKE, TOKENS, 2)
    block = "<|vision_start|>" + "<|vision_pad|>" * TOKENS + "<|vision_end|>"
    assert f"user\nCompare {block} and {block}. How many circles" in text
    ids = resolve_sentinels(QWEN_LIKE, tok)
    prompt = prompt_token_ids(tok, three_turns()[:3], ids, TOKENS, 2)
    assert tok.decode(prompt) == text
    starts = [i for i, t in enumerate(prompt) if t == ids.start]
    between = tok.decode(prompt[starts[0] + TOKENS + 2 : starts[1]])
    assert between == " and "


def test_prompt_without_markers_keeps_every_block_opening_the_first_user_turn(tok):
    history = [{"role": "user", "content": "Which has more?"}, {"role": "assistant", "content": "Left."},
               {"role": "user", "content": "Why?"}]
    text = render_prompt(tok, history, QWEN_LIKE, TOKENS, 2)
    block = "<|vision_start|>" + "<|vision_pad|>" * TOKENS + "<|vision_end|>"
    assert text.startswith(f"<|im_start|>user\n{block}{block}\nWhich has more?<|im_end|>")


def test_a_marker_count_unlike_the_item_count_is_refused_naming_the_row(tok):
    ids = resolve_sentinels(QWEN_LIKE, tok)
    with pytest.raises(CollatorError, match=r"row 'r7'.*2 <image> markers but the row has 3 media items"):
        tokenize_example(tok, three_turns(), ids, TOKENS, 3, row_id="r7")


def test_a_marker_in_an_assistant_turn_stays_text(tok):
    ids = resolve_sentinels(QWEN_LIKE, tok)
    convo = [{"role": "user", "content": "<image> What tag marks a picture?"},
             {"role": "assistant", "content": "It is <image>."}]
    input_ids, _ = tokenize_example(tok, convo, ids, TOKENS, 1)
    assert input_ids.count(ids.start) == 1
    assert "It is <image>." in tok.decode(input_ids)


class _IdentityProjector(torch.nn.Module):
    """Features [items, tokens, width] pass through as soft tokens (width = hidden), so each item stays traceable."""

    def __init__(self) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(()))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features + self.anchor


def _item_features(items: int, width: int) -> torch.Tensor:
    """Item k's every token is the constant k + 1."""
    return torch.arange(1, items + 1, dtype=torch.float32)[:, None, None].expand(items, TOKENS, width).clone()


def _items_at_blocks(ids: list[int], embeds: torch.Tensor, sentinel_ids) -> list[int]:
    """The item each media block (in prompt order) received, read back from the embeddings."""
    return [int(embeds[i + 1, 0]) for i, t in enumerate(ids) if t == sentinel_ids.start]


def test_rollout_embeddings_put_each_item_at_its_own_marker_of_a_three_turn_row(tok):
    from types import SimpleNamespace

    from stitch.rollout.payloads import feature_payload_spec
    from stitch.rollout.prompts import prompt_embeddings

    ids = resolve_sentinels(QWEN_LIKE, tok)
    width = 8
    embed = torch.nn.Embedding(len(tok), width)
    torch.nn.init.zeros_(embed.weight)
    lm = SimpleNamespace(get_input_embeddings=lambda: embed)
    model = SimpleNamespace(lm=lm, projector=_IdentityProjector(), placeholder_id=ids.placeholder,
                            device=torch.device("cpu"))
    payload = feature_payload_spec("features", "image", TOKENS, width)
    prompt = prompt_token_ids(tok, three_turns()[:3], ids, TOKENS, 2)
    with torch.no_grad():
        (embeds,) = prompt_embeddings(payload, model, [("r0", prompt, _item_features(2, width))])
    assert _items_at_blocks(prompt, embeds, ids) == [1, 2]


def test_packing_keeps_each_rows_items_in_marker_order_across_a_pack(tok):
    from stitch.data.packing import Sample, collate_packs
    from stitch.model.scatter import scatter_soft_tokens

    ids = resolve_sentinels(QWEN_LIKE, tok)
    width = 4
    one = [{"role": "user", "content": "<image> How many?"}, {"role": "assistant", "content": "2"}]
    samples = []
    for row_id, convo, items, offset in (("a", three_turns(), 2, 0), ("b", one, 1, 2)):
        input_ids, labels = tokenize_example(tok, convo, ids, TOKENS, items, turns="all")
        samples.append(Sample(row_id, input_ids, labels, _item_features(items, width) + offset))
    batch = collate_packs([samples], tok.pad_token_id, packed=True)
    assert batch.features.shape[0] == 3
    embeds = scatter_soft_tokens(torch.zeros(1, batch.input_ids.shape[1], width), batch.input_ids,
                                 batch.features.reshape(-1, width), ids.placeholder)
    assert _items_at_blocks(batch.input_ids[0].tolist(), embeds[0], ids) == [1, 2, 3]
