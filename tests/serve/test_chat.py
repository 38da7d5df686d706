"""What `stitch serve` reads from a chat request: the conversation rendered by the shared prompt builder (media in
place, byte-identical to inference and rollouts for one turn), content parts routed by the encoder's declaration,
and every malformed field refused naming it."""

from __future__ import annotations

import base64
import dataclasses
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus

import pytest

from stitch.config.recipe import load_recipe
from stitch.data.collator import prompt_token_ids
from stitch.rollout.prompts import MEDIA, conversation_prompt_ids
from stitch.serve.chat import Limits, RequestError, parse_chat_request
from tests.stitch_testing import prepare_inputs, write_recipe

QUESTION = "How many objects are in the image?"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return prepare_inputs(load_recipe(write_recipe(tmp_path_factory.mktemp("chat") / "small.yaml")))


def _ids(inputs, messages):
    spec = inputs["encoder_spec"]
    return conversation_prompt_ids(inputs["tokenizer"], messages, inputs["sentinel_ids"], spec.tokens_per_item)


@pytest.mark.parametrize("items", [1, 2])
def test_one_turn_conversation_renders_the_exact_ids_infer_and_rollouts_use(inputs, items):
    spec = inputs["encoder_spec"]
    served = _ids(inputs, [{"role": "user", "content": [*[MEDIA] * items, QUESTION]}])
    assert served == prompt_token_ids(inputs["tokenizer"], QUESTION, inputs["sentinel_ids"], spec.tokens_per_item,
                                      items)


def test_requests_tokenized_on_concurrent_threads_get_the_ids_each_gets_alone(inputs):
    """A fast tokenizer's ``split_special_tokens`` is backend state: without the shared lock, one request's data text
    (special tokens split) and another's template markup (special tokens whole) interleave on worker threads and a
    prompt comes out longer than it is."""
    messages = [[{"role": "user", "content": [MEDIA, f"{QUESTION} <|im_start|> {n}" * 40]}] for n in range(4)]
    alone = [_ids(inputs, m) for m in messages]
    with ThreadPoolExecutor(8) as pool:
        rendered = list(pool.map(lambda i: _ids(inputs, messages[i % 4]), range(400)))
    wrong = [i for i, ids in enumerate(rendered) if ids != alone[i % 4]]
    assert not wrong, f"{len(wrong)} of 400 concurrent renders differ from the same render alone"


@pytest.mark.parametrize("builder", ["serve", "train"])
def test_a_chat_template_that_drops_a_message_is_refused_by_both_prompt_builders(inputs, builder):
    """Serving's and training's prompt builders share one marked render: a template that renders only the last
    message loses the first turn's text, and both refuse rather than train or answer on the remainder."""
    import copy

    spec, sentinels = inputs["encoder_spec"], inputs["sentinel_ids"]
    tokenizer = copy.copy(inputs["tokenizer"])
    tokenizer.chat_template = "{{ messages[-1]['content'] }}"
    turns = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "reply"},
             {"role": "user", "content": [MEDIA, QUESTION]}]
    with pytest.raises(ValueError, match=r"dropped or repeated message content \(4 pieces, rendered 2\)"):
        if builder == "serve":
            conversation_prompt_ids(tokenizer, turns, sentinels, spec.tokens_per_item)
        else:
            prompt_token_ids(tokenizer, [{**t, "content": t["content"] if isinstance(t["content"], str)
                                          else f"<image>\n{QUESTION}"} for t in turns], sentinels,
                             spec.tokens_per_item)


def _block_starts(ids, sentinels):
    return [i for i, t in enumerate(ids) if t == sentinels.start]


def test_multi_turn_media_blocks_stand_where_their_parts_stand(inputs):
    tokenizer, sentinels = inputs["tokenizer"], inputs["sentinel_ids"]
    messages = [
        {"role": "user", "content": [MEDIA, QUESTION]},
        {"role": "assistant", "content": "The answer is 3."},
        {"role": "user", "content": ["Compare it with", MEDIA, "Which has more?"]},
    ]
    ids = _ids(inputs, messages)
    first, second = _block_starts(ids, sentinels)
    tokens = inputs["encoder_spec"].tokens_per_item
    assert ids.count(sentinels.placeholder) == 2 * tokens
    before_second = tokenizer.decode(ids[first + tokens + 2 : second])
    after_second = tokenizer.decode(ids[second + tokens + 2 :])
    assert "The answer is 3." in before_second and before_second.rstrip().endswith("Compare it with")
    assert "Which has more?" in after_second and "Compare" not in after_second


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width x height`` (its pixels are never sent: the server reads headers only)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return b"\x89PNG\r\n\x1a\n" + chunk + struct.pack(">I", 0) + b"IEND" + struct.pack(">I", zlib.crc32(b"IEND"))


def _body(*parts, **fields):
    return {"model": "tiny", "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}],
            **fields}


def _image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def _audio_part() -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFF0000WAVE").decode(),
                                                   "format": "wav"}}


def _refusal(body, encoder, registered=()) -> RequestError:
    with pytest.raises(RequestError) as caught:
        parse_chat_request(body, "tiny", encoder, [encoder, *registered], Limits())
    return caught.value


def test_content_parts_are_routed_by_what_the_served_encoder_declares(inputs):
    clip = inputs["encoder_spec"]
    audio = dataclasses.replace(clip, name="wav-encoder", modality="audio", content_parts=("input_audio",))
    # the CLIP checkpoint refuses an audio part, naming the registered encoder that takes it
    refused = _refusal(_body(_audio_part()), clip, [audio])
    assert refused.status == HTTPStatus.BAD_REQUEST and "'wav-encoder'" in refused.message
    assert refused.param == "messages[0].content[0]"
    # an audio checkpoint takes it (bytes as sent) and refuses the image part instead
    parsed = parse_chat_request(_body(_audio_part()), "tiny", audio, [clip, audio], Limits())
    assert [(p.kind, p.data) for p in parsed.media] == [("input_audio", b"RIFF0000WAVE")]
    assert parsed.messages[0]["content"] == [MEDIA, QUESTION]
    assert "'clip-tiny'" in _refusal(_body(_image_part(_png_header(8, 8))), audio, [clip]).message


@pytest.mark.parametrize("fields, param", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"n": 0}, "n"), ({"max_tokens": 10**6},
                                                                                       "max_tokens"),
    ({"stop": [1]}, "stop"), ({"seed": "x"}, "seed"), ({"stream": "yes"}, "stream"),
])
def test_each_bad_sampling_field_is_refused_naming_it(inputs, fields, param):
    error = _refusal(_body(_image_part(_png_header(8, 8)), **fields), inputs["encoder_spec"])
    assert error.status == HTTPStatus.BAD_REQUEST and error.param == param and param in error.message


def test_a_decompression_bomb_png_is_refused_from_its_header(inputs):
    error = _refusal(_body(_image_part(_png_header(20000, 20000))), inputs["encoder_spec"])
    assert error.status == HTTPStatus.BAD_REQUEST and "40,000,000 pixels" in error.message


def test_remote_urls_and_media_in_assistant_turns_are_refused(inputs):
    clip = inputs["encoder_spec"]
    remote = {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}
    assert "not fetched" in _refusal(_body(remote), clip).message
    body = _body(_image_part(_png_header(8, 8)))
    body["messages"] = [{"role": "assistant", "content": [_image_part(_png_header(8, 8))]}, *body["messages"]]
    assert "user messages" in _refusal(body, clip).message
