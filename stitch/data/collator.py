"""Prompt rendering and the training collator: the tokenizer-specific half of the data path.

The prompt is the model's chat template over the whole conversation with ``start + placeholder x N + end`` per
media item: where each ``<image>`` marker (``<video>`` in a video layout) of a user (or system) turn stands, or, in
a conversation without markers, opening the first user turn. ``prompt_token_ids`` is the one function that tokenizes it, for training,
GRPO rollouts, evaluation, inference and serving alike, so all of them see byte-identical prompts. A training
sample is that prompt followed by the final answer and EOS; the final answer and EOS carry labels, and with
``turns="all"`` so does every earlier assistant turn (its text and the end-of-turn token after it).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from stitch.data.packing import Batch, Sample, collate_packs
from stitch.data.sentinels import SentinelIds, resolve_sentinels
from stitch.plugins.specs import IMAGE_MARKER, SentinelSpec

IGNORE_INDEX = -100
Messages = Sequence[Mapping[str, str]]


class CollatorError(ValueError):
    """A row cannot be turned into a training sample; the message names the row."""


@dataclass(frozen=True)
class _Sentinels:
    ids: SentinelIds
    start: str
    placeholder: str
    end: str

    @property
    def marker(self) -> str:
        return self.ids.marker


def _sentinels(tokenizer: Any, sentinels: SentinelIds | SentinelSpec) -> _Sentinels:
    if isinstance(sentinels, SentinelSpec):
        return _Sentinels(resolve_sentinels(sentinels, tokenizer), *sentinels.tokens)
    start, placeholder, end = tokenizer.convert_ids_to_tokens([sentinels.start, sentinels.placeholder, sentinels.end])
    return _Sentinels(sentinels, start, placeholder, end)


def _marker(sentinels: SentinelIds | SentinelSpec) -> str:
    return sentinels.marker


def media_block(tokenizer: Any, sentinels: SentinelIds | SentinelSpec, tokens_per_item: int, num_items: int) -> str:
    """``(start + placeholder x tokens_per_item + end) x num_items`` as text."""
    s = _sentinels(tokenizer, sentinels)
    return (s.start + s.placeholder * tokens_per_item + s.end) * num_items


TrainTurns = Literal["all", "last"]


def _conversation(question: str | Messages) -> list[dict[str, str]]:
    if isinstance(question, str):
        return [{"role": "user", "content": question}]
    return [{"role": m["role"], "content": m["content"]} for m in question]


def image_markers(messages: Messages, marker: str = IMAGE_MARKER) -> int:
    """How many ``marker`` markers (``<image>``, or ``<video>`` for a video layout) the conversation's user and
    system turns hold (assistant text keeps its own)."""
    return sum(m["content"].count(marker) for m in messages if m["role"] != "assistant")


def _media_layout(messages: list[dict[str, str]], num_items: int, marker: str) -> tuple[list[int], int]:
    """``(users, markers)``: the user turns' indices and the markers the conversation holds; refuses a prompt
    without a user turn, or markers that do not match ``num_items``."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise CollatorError(f"a prompt needs a user turn; got roles {[m['role'] for m in messages]}")
    markers = image_markers(messages, marker)
    if markers and markers != num_items:
        raise CollatorError(f"the conversation holds {markers} {marker} markers but the row has {num_items} "
                            f"media items; each item needs one marker where it stands, or no marker at all")
    return users, markers


def _content_pieces(message: Mapping[str, str], media: Any, markers: int, marker: str) -> list[Any]:
    """A message's content as pieces: text, and ``media`` where each marker stands (user and system turns)."""
    if not markers or message["role"] == "assistant":
        return [message["content"]]
    pieces: list[Any] = []
    for k, text in enumerate(message["content"].split(marker)):
        if k:
            pieces.append(media)
        if text:
            pieces.append(text)
    return pieces


def render_prompt(
    tokenizer: Any,
    question: str | Messages,
    sentinels: SentinelIds | SentinelSpec,
    tokens_per_item: int,
    num_items: int = 1,
) -> str:
    """The prompt as text (chat template + generation prompt), for display and export: a media block where each
    ``<image>`` marker stands, or, without markers, one per item then a newline opening the first user turn.
    Tokenize prompts with ``prompt_token_ids``, never by tokenizing this text (a sentinel spelled in the question
    would become a control token)."""
    messages = _conversation(question)
    marker = _marker(sentinels)
    users, markers = _media_layout(messages, num_items, marker)
    block = media_block(tokenizer, sentinels, tokens_per_item, 1)
    if markers:
        for message in messages:
            if message["role"] != "assistant":
                message["content"] = message["content"].replace(marker, block)
    elif num_items:
        first = messages[users[0]]
        first["content"] = f"{block * num_items}\n{first['content']}"
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


_MARK = re.compile("\ue000(\\d+)\ue001")  # private-use code points: never in a tokenizer's special tokens


def prompt_token_ids(
    tokenizer: Any,
    question: str | Messages,
    sentinels: SentinelIds | SentinelSpec,
    tokens_per_item: int,
    num_items: int = 1,
) -> list[int]:
    """The prompt's token ids: the chat template's own markup tokenized as usual (its control tokens are
    special), every message's text tokenized with ``split_special_tokens`` (a question that spells
    ``<|vision_start|>`` or ``<|im_end|>`` stays text), and each media block inserted as sentinel ids where its
    ``<image>`` marker stands (without markers: all of them opening the first user turn).

    Training, rollouts, evaluation, DPO, inference and serving all tokenize prompts here.
    """
    return _prompt_with_spans(tokenizer, question, sentinels, tokens_per_item, num_items)[0]


def _prompt_with_spans(
    tokenizer: Any,
    question: str | Messages,
    sentinels: SentinelIds | SentinelSpec,
    tokens_per_item: int,
    num_items: int,
) -> tuple[list[int], dict[int, tuple[int, int]]]:
    """``prompt_token_ids`` and, per message index, the ``[start, end)`` of its content's ids."""
    s = _sentinels(tokenizer, sentinels)
    messages = _conversation(question)
    users, markers = _media_layout(messages, num_items, s.marker)
    media = [s.ids.start, *[s.ids.placeholder] * tokens_per_item, s.ids.end]
    pieces: list[list[int] | str] = []
    owner: list[int] = []  # the message each piece belongs to

    def mark(piece: list[int] | str, message: int) -> str:
        pieces.append(piece)
        owner.append(message)
        return piece_mark(len(pieces) - 1)

    marked = []
    for i, message in enumerate(messages):
        content = "".join(mark(p, i) for p in _content_pieces(message, media, markers, s.marker))
        if num_items and not markers and i == users[0]:
            content = f"{mark(media * num_items, i)}\n{content}"
        marked.append({"role": message["role"], "content": content})
    ids, where = tokenize_marked(tokenizer, marked, pieces)
    spans: dict[int, tuple[int, int]] = {}
    for message, (begin, end) in zip(owner, where, strict=True):
        spans[message] = (spans.get(message, (begin, begin))[0], end)
    return ids, spans


def piece_mark(index: int) -> str:
    """Where piece ``index`` stands in a message's content until ``tokenize_marked`` replaces it."""
    return f"\ue000{index}\ue001"


def tokenize_marked(tokenizer: Any, marked: Messages, pieces: Sequence[list[int] | str]) -> tuple[
        list[int], list[tuple[int, int]]]:
    """Render ``marked`` (messages whose content holds ``piece_mark(i)`` for each piece) through the chat template
    and tokenize it: the template's markup as markup, each text piece as data text, each id piece as it stands,
    at its mark. Returns the ids and each piece's ``[start, end)`` in them. A template that drops or repeats a
    piece is refused."""
    rendered = tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=True)
    ids: list[int] = []
    where: dict[int, tuple[int, int]] = {}
    seen: list[int] = []
    position = 0
    for match in _MARK.finditer(rendered):
        ids += text_ids(tokenizer, rendered[position : match.start()], markup=True)
        index = int(match.group(1))
        seen.append(index)
        piece = pieces[index]
        begin = len(ids)
        ids += piece if isinstance(piece, list) else text_ids(tokenizer, piece, markup=False)
        where[index] = (begin, len(ids))
        position = match.end()
    ids += text_ids(tokenizer, rendered[position:], markup=True)
    if sorted(seen) != list(range(len(pieces))):
        raise CollatorError(f"the chat template of {getattr(tokenizer, 'name_or_path', '?')!r} dropped or repeated "
                            f"message content ({len(pieces)} pieces, rendered {len(seen)})")
    return ids, [where[i] for i in range(len(pieces))]


_SPLIT_STATE = threading.Lock()


def text_ids(tokenizer: Any, text: str, *, markup: bool) -> list[int]:
    """Token ids of template markup (special tokens recognised) or of data text (special-token strings split).

    A fast tokenizer keeps ``split_special_tokens`` as state on its Rust backend, set by each call and read while
    the encoding runs without the GIL; the lock keeps one thread's setting from tokenizing another's text (a
    server tokenizes concurrent requests on worker threads)."""
    if not text:
        return []
    with _SPLIT_STATE:
        return tokenizer(text, add_special_tokens=False, split_special_tokens=not markup)["input_ids"]


def answer_token_ids(tokenizer: Any, answer: str) -> list[int]:
    """The answer's ids, its text tokenized as text (special-token strings split), then EOS."""
    return text_ids(tokenizer, answer, markup=False) + [tokenizer.eos_token_id]


def tokenize_example(
    tokenizer: Any,
    messages: Messages,
    sentinels: SentinelIds | SentinelSpec,
    tokens_per_item: int,
    num_items: int,
    *,
    row_id: str = "?",
    turns: TrainTurns = "last",
) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` for a conversation ending with the assistant's answer.

    ``input_ids`` = prompt ids (``prompt_token_ids`` of every turn before the answer) + answer ids + EOS;
    ``labels`` are ``-100`` on the prompt (media placeholders included) and equal to ``input_ids`` on the
    answer and EOS; with ``turns="all"`` also on every earlier assistant turn's text and the EOS token the chat
    template closes it with. The prompt must hold exactly ``num_items`` media blocks of ``tokens_per_item``
    placeholders: a sentinel token typed into the text itself is refused, naming the row.
    """
    if not messages or messages[-1]["role"] != "assistant":
        raise CollatorError(f"row {row_id!r}: the conversation must end with the assistant's answer")
    s = _sentinels(tokenizer, sentinels)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise CollatorError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no eos_token_id")
    try:
        prompt, spans = _prompt_with_spans(tokenizer, messages[:-1], sentinels, tokens_per_item, num_items)
    except CollatorError as exc:
        raise CollatorError(f"row {row_id!r}: {exc}") from None
    answer = answer_token_ids(tokenizer, messages[-1]["content"])
    sentinel_ids = {s.ids.start, s.ids.placeholder, s.ids.end}
    for role, want in (("start", num_items), ("placeholder", num_items * tokens_per_item), ("end", num_items)):
        got = prompt.count(getattr(s.ids, role))
        if got != want:
            raise CollatorError(
                f"row {row_id!r}: the rendered prompt holds {got} {role} sentinel tokens "
                f"({getattr(s, role)!r}), expected {want} for {num_items} items x {tokens_per_item} tokens; "
                f"does the row's text contain a sentinel token?"
            )
    if sentinel_ids & set(answer):
        raise CollatorError(f"row {row_id!r}: the answer text contains a media sentinel token")
    labels = [IGNORE_INDEX] * len(prompt) + answer
    if turns == "all":
        for index, (start, end) in spans.items():
            if messages[index]["role"] != "assistant":
                continue
            if end < len(prompt) and prompt[end] == eos:  # the turn's end-of-turn token is learned as EOS is
                end += 1
            labels[start:end] = prompt[start:end]
    return prompt + answer, labels


class Collator:
    """Rows ``{"id", "messages", "features" [items, N, W]}`` -> a right-padded ``Batch`` (one row per sample).

    ``Batch`` has ``input_ids``, ``attention_mask``, ``labels``, ``position_ids``, ``features``
    ``[all items, N, W]`` in placeholder order, and ``row_ids``.
    """

    def __init__(
        self,
        tokenizer: Any,
        sentinels: SentinelIds | SentinelSpec,
        tokens_per_item: int,
        feature_width: int,
        *,
        max_length: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.sentinels = sentinels
        self.tokens_per_item = tokens_per_item
        self.feature_width = feature_width
        self.max_length = max_length
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else tokenizer.eos_token_id

    def sample(self, row: Mapping[str, Any]) -> Sample:
        row_id = str(row.get("id", "?"))
        features = row["features"]
        expected = (self.tokens_per_item, self.feature_width)
        if features.dim() != 3 or tuple(features.shape[1:]) != expected:
            raise CollatorError(
                f"row {row_id!r}: features have shape {tuple(features.shape)}; expected "
                f"[items, {expected[0]}, {expected[1]}]"
            )
        input_ids, labels = tokenize_example(
            self.tokenizer, row["messages"], self.sentinels, self.tokens_per_item, features.shape[0], row_id=row_id
        )
        if self.max_length is not None and len(input_ids) > self.max_length:
            raise CollatorError(
                f"row {row_id!r} is {len(input_ids)} tokens, over max_length={self.max_length}; "
                f"truncating would cut the answer or the media block"
            )
        return Sample(row_id, input_ids, labels, features)

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> Batch:
        samples = [self.sample(row) for row in rows]
        batch = collate_packs([[s] for s in samples], self.pad_id, packed=False)
        if not samples or all(s.features.shape[0] == 0 for s in samples):
            batch.features = torch.empty(0, self.tokens_per_item, self.feature_width)
        return batch

