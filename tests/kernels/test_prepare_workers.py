"""Preparation's per-row work in its decode workers: the conversation is tokenized there, its errors still name the
row, column, expected and actual; the report says where the main process spent its time; a fresh run loads the
encoder while its first rows decode; the encoder runs on the caller's torch threads."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest
import torch

from stitch.config.recipe import load_recipe
from stitch.data.prepare import PrepareError, PromptCheck
from stitch.kernels.prepare_workers import ENCODE_PHASES, PhaseClock, ShardEncoder
from tests.stitch_testing import prepare_resolved

pytest.importorskip("stitch_clip", reason="the CLIP encoder comes from the stitch-clip plugin")

from tests.data.test_bad_data import TOKEN_BUDGET, hostile, hostile_recipe  # noqa: E402,F401  (hostile: the fixture)
from tests.data.test_prepare import ENCODER, write_recipe  # noqa: E402


@pytest.fixture(scope="module")
def host_module():
    from stitch.host.host import load_plugins

    return load_plugins()


class _EncoderHost:
    """The plugin host with the test encoder's ``load`` replaced."""

    def __init__(self, inner, load) -> None:
        self.inner = inner
        self.spec = dataclasses.replace(inner.get("encoders", ENCODER), load=load)

    def get(self, kind, name):
        return self.spec if (kind, name) == ("encoders", ENCODER) else self.inner.get(kind, name)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _two_row_recipe(root, second: dict):
    """A good row, then ``second``, prepared with 2 workers; a bad row stops the run."""
    path = root / "ds" / f"{second['id']}.jsonl"
    rows = [{"id": "fine", "image": "imgs/good0.png", "question": "How many?", "answer": "1"}, second]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_recipe(hostile_recipe(root, name=second["id"], on_corrupt="error", partitions={"alignment": [0, 2]},
                                      scan_cap=2, source={"path": str(path), "format": "json"},
                                      prepare={"workers": 2}))


def test_a_too_long_prompt_found_in_a_worker_stops_the_run_naming_row_column_expected_and_actual(hostile,  # noqa: F811
                                                                                                 host_module,
                                                                                                 tmp_path):
    recipe = _two_row_recipe(hostile, {"id": "wordy", "image": "imgs/good0.png", "question": "count " * 4000,
                                       "answer": "x"})
    with pytest.raises(PrepareError) as caught:
        prepare_resolved(recipe, tmp_path / "out", host=host_module, progress=False)
    message = str(caught.value)
    assert "row 'wordy' (stream position 1), column 'question'" in message
    assert f"expected at most stages.alignment.token_budget={TOKEN_BUDGET}" in message
    actual = int(message.split("column 'question': ")[1].split(" tokens")[0])
    assert actual > TOKEN_BUDGET


def test_a_prompt_that_does_not_tokenize_in_a_worker_names_row_and_column_before_its_media(hostile,  # noqa: F811
                                                                                             host_module, tmp_path,
                                                                                             monkeypatch):
    from stitch.data.collator import CollatorError

    original = PromptCheck.tokenize

    def refuse_marked(self, conversation, num_items, row_id="?"):
        if "UNTOKENIZABLE" in conversation[0]["content"]:
            raise CollatorError(f"row {row_id!r}: the rendered prompt holds 0 start sentinel tokens, expected 1")
        return original(self, conversation, num_items, row_id)

    monkeypatch.setattr(PromptCheck, "tokenize", refuse_marked)  # before the workers fork: they inherit it
    recipe = _two_row_recipe(hostile, {"id": "odd", "image": "imgs/no-such.png", "question": "UNTOKENIZABLE",
                                       "answer": "1"})
    with pytest.raises(PrepareError) as caught:
        prepare_resolved(recipe, tmp_path / "out", host=host_module, progress=False)
    message = str(caught.value)
    # the prompt is judged first: the missing file of the same row is not what is reported
    assert "row 'odd' (stream position 1), column 'question': does not tokenize with 'qwen3.5-tiny'" in message
    assert "holds 0 start sentinel tokens, expected 1" in message and "not found" not in message


@pytest.mark.parametrize("workers", [0, 2])
def test_conversations_are_tokenized_in_the_decode_workers_when_there_are_workers(tmp_path, host_module,
                                                                                  monkeypatch, workers):
    main, calls = os.getpid(), []
    original = PromptCheck.tokenize

    def counted(self, *args, **kwargs):
        if os.getpid() == main:  # a forked worker appends to its own copy of the list
            calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PromptCheck, "tokenize", counted)
    data = {"source": {"builtin": "counting-shapes", "rows": 12, "caption_rows": 0, "seed": 0},
            "partitions": {"train": [0, 12]}, "scan_cap": 12, "prepare": {"workers": workers}}
    report = prepare_resolved(load_recipe(write_recipe(tmp_path, **data)), tmp_path / "out", host=host_module, progress=False)
    assert report.total_rows == 12
    assert len(calls) == (12 if workers == 0 else 0)
    assert report.worker_seconds["prompt"] > 0 and report.worker_seconds["media"] > 0


def test_report_phase_seconds_name_every_phase_and_add_up_to_the_whole_call(tmp_path, host_module):
    started = time.perf_counter()
    report = prepare_resolved(load_recipe(write_recipe(tmp_path, prepare={"workers": 1})), tmp_path / "out", host=host_module,
                     progress=False)
    elapsed = time.perf_counter() - started
    phases = report.phase_seconds
    assert set(phases) == {*PhaseClock.PHASES, "total"}
    assert report.seconds <= phases["total"] <= elapsed
    assert sum(v for k, v in phases.items() if k != "total") == pytest.approx(phases["total"], abs=0.01)
    assert phases["startup"] > 0 and phases["media_wait"] > 0
    assert set(report.encode_seconds) == set(ENCODE_PHASES) and report.encode_seconds["encode"] > 0
    written = json.loads((tmp_path / "out" / "prepare-report.json").read_text())
    assert written["phase_seconds"] == phases and written["worker_seconds"] == report.worker_seconds
    assert written["encode_seconds"] == report.encode_seconds


def test_phase_clock_pauses_the_outer_phase_while_an_inner_one_runs():
    clock = PhaseClock()
    with clock("encode"):
        time.sleep(0.02)
        with clock("encoder_load"):
            time.sleep(0.05)
    assert clock.seconds["encoder_load"] >= 0.05
    assert 0.02 <= clock.seconds["encode"] < 0.05


def test_a_fresh_run_loads_the_encoder_while_its_first_shard_decodes_and_a_rerun_never_loads_it(tmp_path,
                                                                                                 host_module):
    from stitch.data import prepare as prep

    events: list[tuple[str, float]] = []
    inner = host_module.get("encoders", ENCODER)

    def load(source, device, dtype):
        events.append(("load", time.perf_counter()))
        return inner.load(source, device, dtype)

    host = _EncoderHost(host_module, load)
    original = prep._Preparation.decoded_rows

    def decoded_rows(self, ds, rows, pool):
        for n, item in enumerate(original(self, ds, rows, pool)):
            if n == 0:
                events.append(("first row decoded", time.perf_counter()))
            yield item

    recipe = load_recipe(write_recipe(tmp_path, prepare={"workers": 1}))
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(prep._Preparation, "decoded_rows", decoded_rows)
        prepare_resolved(recipe, tmp_path / "out", host=host, progress=False)
    finally:
        mp.undo()
    assert [name for name, _ in sorted(events, key=lambda e: e[1])] == ["load", "first row decoded"]
    events.clear()
    report = prepare_resolved(recipe, tmp_path / "out", host=host, progress=False)
    assert report.shards_reused == 4 and events == []


def test_the_wait_for_a_slow_loading_encoder_is_reported_as_encoder_load_not_as_encode(tmp_path, host_module,
                                                                                       monkeypatch):
    """The loader thread returns 0.5 s after the encode thread has made its first batch's input (and waits for
    the encoder): that half second is ``encoder_load``, and ``encode`` does not count it again."""
    import threading


    inner = host_module.get("encoders", ENCODER)
    first_input = threading.Event()
    batch = ShardEncoder.batch

    def recorded_batch(self, items):
        first_input.set()
        return batch(self, items)

    def slow_load(source, device, dtype):
        assert first_input.wait(20)
        time.sleep(0.5)
        return inner.load(source, device, dtype)

    monkeypatch.setattr(ShardEncoder, "batch", recorded_batch)
    report = prepare_resolved(load_recipe(write_recipe(tmp_path, prepare={"workers": 1})), tmp_path / "out",
                     host=_EncoderHost(host_module, slow_load), progress=False)
    assert report.encode_seconds["encoder_load"] >= 0.5
    assert report.encode_seconds["encode"] < report.seconds - report.encode_seconds["encoder_load"]


def _recording_encoder(host, record):
    """The test encoder, calling ``record()`` as each encode begins."""
    inner = host.get("encoders", ENCODER).load(host.get("encoders", ENCODER).source, "cpu", torch.float16)

    class Recording:
        def encode(self, items):
            record()
            return inner.encode(items)

    return Recording()


def test_the_encoder_runs_on_the_callers_torch_threads_and_they_are_restored(tmp_path, host_module):
    seen = []
    recording = _recording_encoder(host_module, lambda: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        prepare_resolved(load_recipe(write_recipe(tmp_path, prepare={"workers": 1})), tmp_path / "out", host=host_module,
                encoder=recording, progress=False)
        assert seen and set(seen) == {2}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_objects_from_before_prepare_are_out_of_full_collections_while_it_encodes_and_back_after(tmp_path,
                                                                                               host_module):
    """gc.freeze for the run: a full collection walks only what prepare allocated (with the libraries' ~0.4 M
    objects one took 0.21-0.29 s on the CPU machine), collection is on while it encodes, and the objects are
    collectable again once it returns; a program that froze objects itself keeps them frozen."""
    import gc

    from stitch.kernels.prepare_workers import PARKED_BY_PYTHON

    seen = []  # (objects frozen, collection on) as each encode begins
    recording = _recording_encoder(host_module, lambda: seen.append((gc.get_freeze_count(), gc.isenabled())))
    assert gc.get_freeze_count() <= PARKED_BY_PYTHON and gc.isenabled()
    before = len(gc.get_objects())
    prepare_resolved(load_recipe(write_recipe(tmp_path, prepare={"workers": 1})), tmp_path / "out", host=host_module,
            encoder=recording, progress=False)
    assert seen and min(frozen for frozen, _ in seen) >= before // 2  # the objects of before, frozen
    assert all(enabled for _, enabled in seen)  # settled: what prepare makes is collected
    assert gc.get_freeze_count() <= PARKED_BY_PYTHON and gc.isenabled()

    gc.freeze()  # the program's own freeze: prepare leaves it as it is
    try:
        ours = gc.get_freeze_count()
        seen.clear()
        (tmp_path / "again").mkdir()
        prepare_resolved(load_recipe(write_recipe(tmp_path / "again", prepare={"workers": 1})), tmp_path / "again" / "out",
                host=host_module, encoder=recording, progress=False)
        assert seen and max(frozen for frozen, _ in seen) <= ours  # nothing more frozen (some freed)
        assert gc.get_freeze_count() >= ours // 2  # and not unfrozen by prepare
    finally:
        gc.unfreeze()


def test_the_objects_python_3_12_parks_itself_do_not_count_as_the_programs_freeze(monkeypatch):
    """Python 3.12 keeps its immortal objects (375 at start-up) in the permanent generation, where a freeze puts
    objects: that count must not read as the program's own freeze, or prepare leaves full collections on.
    Simulated on any Python: what is frozen here is what the interpreter parked, and a count above it is the
    program's."""
    import gc

    import stitch.kernels.prepare_workers as prep

    gc.freeze()  # as if the interpreter had parked these
    try:
        monkeypatch.setattr(prep, "PARKED_BY_PYTHON", gc.get_freeze_count())
        with prep.ObjectsFrozen() as frozen:
            assert frozen.active and not gc.isenabled()  # start-up: collection off, the objects frozen
            frozen.settle()
            assert gc.isenabled()
        assert gc.isenabled()
        monkeypatch.setattr(prep, "PARKED_BY_PYTHON", gc.get_freeze_count())
        gc.freeze()  # and now one more than the interpreter's: the program's own
        with prep.ObjectsFrozen() as frozen:
            assert not frozen.active and gc.isenabled()
    finally:
        gc.unfreeze()


def test_a_fresh_run_warms_the_encoder_up_in_its_loader_thread_before_the_first_encode(tmp_path, host_module):
    import threading

    inner = host_module.get("encoders", ENCODER)
    events: list[tuple[str, str, int | None]] = []

    class Warmable:
        def __init__(self, encoder) -> None:
            self.encoder = encoder

        def warm_up(self, batch_size: int) -> None:
            events.append(("warm_up", threading.current_thread().name, batch_size))

        def encode(self, items):
            events.append(("encode", threading.current_thread().name, None))
            return self.encoder.encode(items)

    host = _EncoderHost(host_module, lambda source, device, dtype: Warmable(inner.load(source, device, dtype)))
    recipe = load_recipe(write_recipe(tmp_path, prepare={"workers": 1}))
    prepare_resolved(recipe, tmp_path / "out", host=host, progress=False)
    kinds = [kind for kind, _, _ in events]
    assert kinds[0] == "warm_up" and kinds.count("warm_up") == 1 and "encode" in kinds
    assert events[0][1].startswith("stitch-encoder-load") and events[0][2] == recipe.data.encode_batch_size
    assert all(not thread.startswith("stitch-encoder-load") for kind, thread, _ in events if kind == "encode")


def test_the_next_shard_is_gathered_while_the_encode_thread_encodes_one(tmp_path, host_module):
    """The first shard's encode waits until the main thread has gathered the whole second shard (it has taken the
    first row of the third): with the encode on the main thread that row could never be taken, and the encode
    would give up waiting at the timeout. The output is the same bytes as a run whose encoder never waits."""
    import threading

    from stitch.data import prepare as prep
    from tests.data.test_prepare import dir_snapshot

    inner = host_module.get("encoders", ENCODER)
    recipe = load_recipe(write_recipe(tmp_path, prepare={"workers": 1}))
    shard_rows = recipe.data.shard_rows
    second_shard_gathered = threading.Event()
    waited: list[bool] = []

    class Waiting:
        def __init__(self, encoder) -> None:
            self.encoder = encoder

        def encode(self, items):
            if not waited:
                waited.append(second_shard_gathered.wait(timeout=30))
            return self.encoder.encode(items)

    original = prep._Preparation.valid_rows

    def valid_rows(self, ds, stream, pool=None):
        for ordinal, row in enumerate(original(self, ds, stream, pool)):
            if ordinal >= 2 * shard_rows:
                second_shard_gathered.set()
            yield row

    host = _EncoderHost(host_module, lambda source, device, dtype: Waiting(inner.load(source, device, dtype)))
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(prep._Preparation, "valid_rows", valid_rows)
        report = prepare_resolved(recipe, tmp_path / "out", host=host, progress=False)
    finally:
        mp.undo()
    assert waited == [True] and report.shards_encoded == 4
    prepare_resolved(recipe, tmp_path / "plain", host=host_module, progress=False)
    assert dir_snapshot(tmp_path / "out") == dir_snapshot(tmp_path / "plain")


def test_an_encoder_answering_the_wrong_shape_stops_the_run_naming_the_rows_and_shapes_and_writes_no_manifest(
        tmp_path, host_module):
    inner = host_module.get("encoders", ENCODER)

    class Short:
        def __init__(self, encoder) -> None:
            self.encoder = encoder

        def encode(self, items):
            return self.encoder.encode(items)[:, :-1]

    host = _EncoderHost(host_module, lambda source, device, dtype: Short(inner.load(source, device, dtype)))
    recipe = load_recipe(write_recipe(tmp_path, prepare={"workers": 1}))
    with pytest.raises(PrepareError, match=r"returned features of shape \(\d+, \d+, \d+\) for rows \S+\.\.\S+; its "
                                           r"spec declares"):
        prepare_resolved(recipe, tmp_path / "out", host=host, progress=False)
    assert not (tmp_path / "out" / "manifest.jsonl").exists()
    assert not list((tmp_path / "out").rglob("*.safetensors"))
    assert not (tmp_path / "out").exists()  # a refusal leaves no half-written output (no row was skipped to report)
