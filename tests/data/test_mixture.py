"""Mixtures of partitions in the packed stream: rows drawn in proportion to the weights, the same rows after a
resume from the JSON state a checkpoint keeps, and a one-partition mixture drawing exactly as a partition filter."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

from stitch.data.mixture import Mixture
from stitch.data.packing import PackedStream, Sample


def _manifest(path: Path, sizes: dict[str, int]) -> Path:
    """Interleaved rows of each partition (only the fields the stream reads before ``make_sample``)."""
    rows = [{"id": f"{name}-{i}", "partition": name} for name, n in sizes.items() for i in range(n)]
    rows.sort(key=lambda r: int(r["id"].rsplit("-", 1)[1]))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _sample(row: dict) -> Sample:
    return Sample(row["id"], [1, 2], [1, 2], torch.zeros(0))


def _stream(manifest: Path, **kwargs) -> PackedStream:
    return PackedStream(manifest, _sample, token_budget=8, buffer_size=4, seed=3, pack=False, **kwargs)


def _ids(stream: PackedStream, n: int) -> list[str]:
    return [s.row_id for _ in range(n) for s in stream.next_pack()]


def test_rows_are_drawn_in_proportion_to_the_mixture_weights_and_the_report_says_so(tmp_path):
    stream = _stream(_manifest(tmp_path / "m.jsonl", {"a": 30, "b": 30}), mixture={"a": 0.8, "b": 0.2})
    counts = Counter(i.split("-")[0] for i in _ids(stream, 1000))
    assert abs(counts["a"] / 1000 - 0.8) < 0.04, counts
    report = stream.mixture.report()
    assert report["a"]["weight"] == 0.8 and report["a"]["drawn"] == counts["a"]
    assert report["b"]["share"] == round(counts["b"] / 1000, 4)


def test_a_stream_resumed_from_its_json_state_draws_the_same_rows_as_one_never_stopped(tmp_path):
    manifest = _manifest(tmp_path / "m.jsonl", {"a": 7, "b": 5, "c": 3})
    mixture = {"a": 2.0, "b": 1.0, "c": 1.0}
    straight, first = _stream(manifest, mixture=mixture), _stream(manifest, mixture=mixture)
    want = _ids(straight, 90)
    got = _ids(first, 37)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint keeps
    resumed = _stream(manifest, mixture=mixture)
    resumed.load_state_dict(state)
    got += _ids(resumed, 53)
    assert got == want
    assert resumed.mixture.drawn == straight.mixture.drawn


def test_a_one_partition_mixture_draws_exactly_as_the_partition_filter_does(tmp_path):
    manifest = _manifest(tmp_path / "m.jsonl", {"a": 9, "b": 4})
    filtered = _stream(manifest, rows=lambda row: row["partition"] == "a")
    mixed = _stream(manifest, mixture={"a": 1.0})
    assert _ids(mixed, 40) == _ids(filtered, 40)


def test_mixture_pick_is_seeded_and_keeps_each_partitions_pool():
    import random

    pools = {"x": ["x0", "x1"], "y": ["y0"]}
    runs = []
    for _ in range(2):
        mixture, rng = Mixture({"x": 1, "y": 3}, 5), random.Random(1)
        runs.append([mixture.pick(pools, rng) for _ in range(400)])
    assert runs[0] == runs[1]
    assert 0.2 < sum(d.startswith("x") for d in runs[0]) / 400 < 0.3
