"""Preparation end to end on the demo dataset with the tiny CLIP encoder: cache layout, budgets, resume."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from stitch.config.recipe import load_recipe
from stitch.data.feature_cache import CACHE_DIRNAME, MANIFEST_NAME, PreparedData
from stitch.data.prepare import BudgetExceeded, PrepareError
from tests.stitch_testing import prepare_resolved

pytest.importorskip("stitch_clip", reason="the tiny CLIP encoder comes from the stitch-clip plugin")

ENCODER = "clip-tiny"
TOKENS, WIDTH = 49, 768


def write_recipe(tmp_path: Path, **data_overrides) -> Path:
    """A small demo-shaped recipe: 48 rows in 4 shards of 12 (1 alignment, 2 train, 1 grpo), fp16 features."""
    data = {
        "source": {"builtin": "counting-shapes", "rows": 48, "caption_rows": 12, "seed": 0},
        "columns": {"id": "id", "media": "image", "question": "question", "answer": "answer"},
        "partitions": {"alignment": [0, 12], "train": [12, 36], "grpo": [36, 48]},
        "scan_cap": 64,
        "budgets": {"transient_mib": 64, "retained_mib": 16},
        "feature_dtype": "float16",
        "encode_batch_size": 6,
        "shard_rows": 12,
    }
    data.update(data_overrides)
    recipe = {"name": "small", "model": "qwen3.5-tiny", "encoder": ENCODER, "projector": "mlp2x_gelu", "data": data}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


class Killed(BaseException):
    """Stands in for a kill: not an Exception, so nothing in prepare() may swallow it."""


class CountingEncoder:
    """Wraps a real encoder; counts calls and can fail on a given call (a kill in the middle of a run)."""

    def __init__(self, inner, fail_on_call: int | None = None) -> None:
        self.inner, self.fail_on_call = inner, fail_on_call
        self.calls = self.items = 0

    def encode(self, items):
        self.calls += 1
        if self.fail_on_call is not None and self.calls == self.fail_on_call:
            raise Killed("killed mid-run")
        self.items += len(items)
        return self.inner.encode(items)


@pytest.fixture(scope="module")
def clip(host_module):
    spec = host_module.get("encoders", ENCODER)
    return spec.load(spec.source, "cpu", torch.float16)


@pytest.fixture(scope="module")
def host_module():
    from stitch.host.host import load_plugins

    return load_plugins()


def dir_snapshot(root: Path) -> dict[str, bytes]:
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != "prepare-report.json")
    return {str(p.relative_to(root)): p.read_bytes() for p in files}


def test_prepare_writes_manifest_rows_with_features_text_and_provenance(tmp_path, clip, host_module):
    recipe = load_recipe(write_recipe(tmp_path))
    report = prepare_resolved(recipe, tmp_path / "out", host=host_module, encoder=clip, progress=False)
    assert report.rows == {"alignment": 12, "train": 24, "grpo": 12}
    data = PreparedData(tmp_path / "out")
    rows = list(data.rows())
    assert [r.partition for r in rows] == ["alignment"] * 12 + ["train"] * 24 + ["grpo"] * 12
    first, counting = rows[0], rows[12]
    assert first.question == "Describe the image." and "object" in first.answer
    assert counting.question == "How many objects are in the image?" and counting.answer.startswith("The answer is")
    assert (first.tokens, first.width, first.dtype) == (TOKENS, WIDTH, "float16")
    assert first.provenance["encoder"] == ENCODER and first.provenance["dataset"].startswith("builtin:counting-shapes")
    features = data.features(counting)
    assert features.shape == (1, TOKENS, WIDTH) and features.dtype == torch.float16
    # the cached features are the encoder's output for that row's image, not a neighbour's
    from stitch.demo.data import make_rows

    decode = host_module.get("encoders", ENCODER).decode_item
    own, neighbour = (clip.encode([decode(r["image"])]).float() for r in make_rows(14, 12)[12:14])
    assert torch.allclose(features.float(), own, atol=2e-2, rtol=2e-2)
    assert not torch.allclose(features.float(), neighbour, atol=2e-2, rtol=2e-2)
    # no raw media is retained: only shards and the manifest (plus the report)
    kept = {p.name for p in (tmp_path / "out").iterdir()}
    assert kept == {CACHE_DIRNAME, MANIFEST_NAME, "prepare-report.json"}
    cached = {p.name for p in (tmp_path / "out" / CACHE_DIRNAME).iterdir()}  # shards and their sha256 sidecars
    shards = {n for n in cached if n.endswith(".safetensors")}
    assert shards and cached == shards | {n + ".sha256" for n in shards}


@pytest.mark.parametrize("dtype,elt", [("float16", 2), ("float32", 4)])
def test_retained_bytes_per_row_stay_within_5_percent_of_the_feature_payload(tmp_path, host_module, dtype, elt):
    recipe = load_recipe(write_recipe(tmp_path, feature_dtype=dtype, budgets={"transient_mib": 64, "retained_mib": 32}))
    report = prepare_resolved(recipe, tmp_path / "out", host=host_module, progress=False)
    payload = TOKENS * WIDTH * elt
    on_disk = sum(p.stat().st_size for p in (tmp_path / "out" / CACHE_DIRNAME).iterdir())
    on_disk += (tmp_path / "out" / MANIFEST_NAME).stat().st_size
    assert report.retained_bytes == on_disk
    assert report.payload_bytes_per_row == payload
    assert report.retained_bytes_per_row <= 1.05 * payload, report.retained_bytes_per_row / payload


def test_rerun_reuses_every_shard_without_calling_the_encoder(tmp_path, clip, host_module):
    recipe = load_recipe(write_recipe(tmp_path))
    first = prepare_resolved(recipe, tmp_path / "out", host=host_module, encoder=CountingEncoder(clip), progress=False)
    before = dir_snapshot(tmp_path / "out")
    again = CountingEncoder(clip)
    second = prepare_resolved(recipe, tmp_path / "out", host=host_module, encoder=again, progress=False)
    assert again.calls == 0
    assert (second.shards_encoded, second.shards_reused) == (0, first.shards_encoded)
    assert dir_snapshot(tmp_path / "out") == before


def test_a_rerun_removes_temp_files_a_killed_writer_left_including_safetensors_own(tmp_path, clip, host_module):
    # safetensors >= 0.8 writes to a .tmpXXXXXX file beside the target and renames it; a SIGKILL mid-write leaves
    # it behind, under a name that is not stitch's own .tmp-<pid>-<shard>
    recipe = load_recipe(write_recipe(tmp_path))
    prepare_resolved(recipe, tmp_path / "out", host=host_module, encoder=CountingEncoder(clip), progress=False)
    before = dir_snapshot(tmp_path / "out")
    cache = tmp_path / "out" / CACHE_DIRNAME
    (cache / ".tmpB9tdK3").write_bytes(b"half a shard")
    (cache / f".tmp-{os.getpid()}-0123.safetensors").write_bytes(b"half another")
    prepare_resolved(recipe, tmp_path / "out", host=host_module, encoder=CountingEncoder(clip), progress=False)
    assert dir_snapshot(tmp_path / "out") == before


def test_interrupted_prepare_resumes_without_reencoding_finished_shards(tmp_path, clip, host_module):
    recipe = load_recipe(write_recipe(tmp_path))  # shards of 12 rows, encoded in batches of 6
    reference = prepare_resolved(recipe, tmp_path / "reference", host=host_module, encoder=clip, progress=False)
    assert reference.shards_encoded == 4

    killed = CountingEncoder(clip, fail_on_call=5)  # dies on shard 3, after shards 1-2 (4 calls) finished
    with pytest.raises(Killed):
        prepare_resolved(recipe, tmp_path / "out", host=host_module, encoder=killed, progress=False)
    assert len(list((tmp_path / "out" / CACHE_DIRNAME).glob("*.safetensors"))) == 2
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()

    resumed_encoder = CountingEncoder(clip)
    resumed = prepare_resolved(recipe, tmp_path / "out", host=host_module, encoder=resumed_encoder, progress=False)
    assert (resumed.shards_reused, resumed.shards_encoded) == (2, 2)
    assert resumed_encoder.items == 24  # only the two unfinished shards' rows
    assert dir_snapshot(tmp_path / "out") == dir_snapshot(tmp_path / "reference")


KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, torch
    from stitch.host.host import load_plugins
    from stitch.config.recipe import load_recipe
    sys.path.insert(0, sys.argv[3])  # the repository root, above the tests package
    from tests.stitch_testing import prepare_resolved

    host = load_plugins()
    spec = host.get("encoders", "clip-tiny")
    inner = spec.load(spec.source, "cpu", torch.float16)

    class KilledAfterTwoShards:
        calls = 0
        def encode(self, items):
            KilledAfterTwoShards.calls += 1
            if KilledAfterTwoShards.calls == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            return inner.encode(items)

    prepare_resolved(load_recipe(sys.argv[1]), sys.argv[2], host=host, encoder=KilledAfterTwoShards(), progress=False)
    """
)


def test_sigkilled_prepare_leaves_only_whole_shards_and_resumes_to_the_same_output(tmp_path, clip, host_module):
    recipe_path = write_recipe(tmp_path)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", KILL_SCRIPT, str(recipe_path), str(out), str(Path(__file__).resolve().parents[2])],
        env={**os.environ}, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    files = sorted(p.name for p in (out / CACHE_DIRNAME).iterdir() if p.suffix == ".safetensors")
    whole = [name for name in files if not name.startswith(".tmp-")]
    # the shard being encoded (the third) never lands; the second may still have been in the writer thread, so
    # it is whole or a partial file that no run may read
    assert len(whole) in (1, 2) and len(files) - len(whole) <= 1, files
    recipe = load_recipe(recipe_path)
    resumed_encoder = CountingEncoder(clip)
    resumed = prepare_resolved(recipe, out, host=host_module, encoder=resumed_encoder, progress=False)
    assert resumed.shards_reused == len(whole) and resumed_encoder.items == 48 - 12 * len(whole)
    assert not [p for p in (out / CACHE_DIRNAME).iterdir() if p.name.startswith(".tmp-")]
    reference = tmp_path / "reference"
    prepare_resolved(recipe, reference, host=host_module, encoder=clip, progress=False)
    assert dir_snapshot(out) == dir_snapshot(reference)


def _kill_at_second_rename(monkeypatch, suffix: str) -> list[Path]:
    """The second shard's writer dies at the rename onto its ``*<suffix>`` file: ``.sha256`` kills it between
    writing the sidecar's temp file and renaming it; ``.safetensors``, after the sidecar landed, before the shard.
    Returns the renames' targets; the second is the one that never happened. (Run it with 0 decode workers: the
    pool's bookkeeping reads the process id this changes.)"""
    replace, seen = os.replace, []

    def dying_replace(src, dst, *args, **kwargs):
        if str(dst).endswith(suffix):
            seen.append(dst)
            if len(seen) == 2:
                raise Killed
        return replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", dying_replace)
    killed_pid = os.getpid() + 1  # the resume runs in another process than the killed run: its temp names differ
    monkeypatch.setattr(os, "getpid", lambda: killed_pid)
    return seen


@pytest.mark.parametrize("suffix", [".sha256", ".safetensors"])
def test_a_run_killed_at_a_shard_or_sidecar_rename_resumes_to_the_reference_bytes(tmp_path, clip, host_module,
                                                                                   monkeypatch, suffix):
    """Whatever a killed writer left beside the whole shards (a sidecar's temp file, a sidecar whose shard never
    landed) is gone or rewritten after the resume: the output equals an uninterrupted run's, file for file."""
    recipe = load_recipe(write_recipe(tmp_path, prepare={"workers": 0}))
    prepare_resolved(recipe, tmp_path / "reference", host=host_module, encoder=clip, progress=False)
    with monkeypatch.context() as patch:
        renames = _kill_at_second_rename(patch, suffix)
        with pytest.raises(Killed):  # the writer thread's death reaches prepare() when it records that shard
            prepare_resolved(recipe, tmp_path / "out", host=host_module, encoder=clip, progress=False)
    cache = tmp_path / "out" / CACHE_DIRNAME
    killed = Path(str(renames[1]).removesuffix(".sha256"))
    whole = {p.name for p in cache.glob("*.safetensors")}
    leftovers = {p.name for p in cache.iterdir()} - whole - {name + ".sha256" for name in whole}
    assert killed.name not in whole and leftovers  # the sidecar's temp file, or the shard-less sidecar
    resumed = prepare_resolved(recipe, tmp_path / "out", host=host_module, encoder=clip, progress=False)
    assert (resumed.shards_reused, resumed.shards_encoded) == (len(whole), 4 - len(whole))
    assert dir_snapshot(tmp_path / "out") == dir_snapshot(tmp_path / "reference")


def test_a_sidecar_whose_shard_never_landed_is_removed_with_the_orphan_shards(tmp_path, clip, host_module,
                                                                              monkeypatch):
    """A killed run's sidecar for a shard it never renamed into place, then a run of another recipe (other shard
    names): the sidecar goes, as an orphan shard of an earlier recipe does."""
    with monkeypatch.context() as patch:
        renames = _kill_at_second_rename(patch, ".safetensors")
        with pytest.raises(Killed):
            prepare_resolved(load_recipe(write_recipe(tmp_path, prepare={"workers": 0})), tmp_path / "out", host=host_module,
                    encoder=clip, progress=False)
    cache = tmp_path / "out" / CACHE_DIRNAME
    shards = {p.name for p in cache.glob("*.safetensors")}
    assert not renames[1].exists() and Path(f"{renames[1]}.sha256").is_file()  # a sidecar without its shard
    prepare_resolved(load_recipe(write_recipe(tmp_path, shard_rows=6)), tmp_path / "out", host=host_module, encoder=clip,
            progress=False)
    sidecars = {p.name for p in cache.glob("*.sha256")}
    assert sidecars == {p.name + ".sha256" for p in cache.glob("*.safetensors")} and not shards & {
        p.name for p in cache.glob("*.safetensors")}


def _corrupt_parquet(tmp_path: Path) -> Path:
    import pyarrow.parquet as pq
    from datasets import Dataset, Features, Image, Value

    from stitch.demo.data import make_rows

    rows = make_rows(20, 0, seed=3)
    rows[5]["image"] = {"bytes": b"definitely not a png", "path": "broken.png"}
    for row in rows:
        del row["count"], row["task"]
    features = Features({"id": Value("string"), "image": Image(), "question": Value("string"), "answer": Value("string")})
    path = tmp_path / "corrupt.parquet"
    pq.write_table(Dataset.from_list(rows, features=features).data.table, path)
    return path


def test_corrupt_image_stops_preparation_naming_row_and_column(tmp_path, host_module):
    source = {"path": str(_corrupt_parquet(tmp_path)), "format": "parquet"}
    recipe = load_recipe(write_recipe(tmp_path, source=source, partitions={"train": [0, 12]}, scan_cap=20))
    with pytest.raises(PrepareError) as err:
        prepare_resolved(recipe, tmp_path / "out", host=host_module, progress=False)
    message = str(err.value)
    assert "'shapes-3-000005'" in message and "column 'image'" in message and "on_corrupt: skip" in message


def test_corrupt_image_is_skipped_counted_and_reported_when_on_corrupt_is_skip(tmp_path, host_module):
    source = {"path": str(_corrupt_parquet(tmp_path)), "format": "parquet"}
    recipe = load_recipe(
        write_recipe(tmp_path, source=source, partitions={"train": [0, 12]}, scan_cap=20, on_corrupt="skip")
    )
    report = prepare_resolved(recipe, tmp_path / "out", host=host_module, progress=False)
    assert [s["id"] for s in report.skipped] == ["shapes-3-000005"] and report.skipped[0]["column"] == "image"
    ids = [r.id for r in PreparedData(tmp_path / "out").rows()]
    # the corrupt row takes no valid-row ordinal: the partition is filled by the next row
    assert len(ids) == 12 and "shapes-3-000005" not in ids and ids[-1] == "shapes-3-000012"
    assert json.loads((tmp_path / "out" / "prepare-report.json").read_text())["skipped"] == report.skipped


def test_missing_column_names_the_column_the_recipe_field_and_the_row(tmp_path, host_module):
    columns = {"id": "id", "media": "picture", "question": "question", "answer": "answer"}
    recipe = load_recipe(write_recipe(tmp_path, columns=columns))
    with pytest.raises(PrepareError) as err:
        prepare_resolved(recipe, tmp_path / "out", host=host_module, progress=False)
    message = str(err.value)
    assert "'picture'" in message and "data.columns.media" in message and "'shapes-0-000000'" in message


def test_missing_rejected_column_names_the_column_and_data_columns_rejected(tmp_path, host_module):
    columns = {"id": "id", "media": "image", "question": "question", "answer": "answer", "rejected": "worse"}
    recipe = load_recipe(write_recipe(tmp_path, columns=columns))
    with pytest.raises(PrepareError, match=r"'shapes-0-000000'.*'worse' \(data\.columns\.rejected\)"):
        prepare_resolved(recipe, tmp_path / "out", host=host_module, progress=False)


def _rows_with_rejected(tmp_path: Path, rejected: list) -> Path:
    names = _write_images(tmp_path / "data" / "images", len(rejected))
    with open(tmp_path / "data" / "rows.jsonl", "w") as handle:
        for i, (name, worse) in enumerate(zip(names, rejected, strict=True)):
            handle.write(json.dumps({"id": f"r{i}", "image": f"images/{name}", "question": "What colour?",
                                     "answer": "red", "worse": worse}) + "\n")
    return tmp_path / "data" / "rows.jsonl"


def test_rejected_column_is_kept_in_the_manifest_and_an_empty_one_is_an_invalid_row(tmp_path, clip, host_module):
    source = {"path": str(_rows_with_rejected(tmp_path, ["blue", "", "green", "cyan"])), "format": "json"}
    columns = {"id": "id", "media": "image", "question": "question", "answer": "answer", "rejected": "worse"}
    recipe = load_recipe(write_recipe(tmp_path, source=source, columns=columns, partitions={"train": [0, 3]},
                                      scan_cap=4, on_corrupt="skip"))
    report = prepare_resolved(recipe, tmp_path / "out", host=host_module, encoder=clip, progress=False)
    assert report.skipped[0]["id"] == "r1" and report.skipped[0]["column"] == "worse"
    rows = list(PreparedData(tmp_path / "out").rows())
    assert [(r.id, r.extra) for r in rows] == [("r0", {"rejected": "blue"}), ("r2", {"rejected": "green"}),
                                               ("r3", {"rejected": "cyan"})]
    assert rows[0].task_row().extra == {"rejected": "blue"}


def test_retained_budget_refuses_before_encoding_anything(tmp_path, clip, host_module):
    recipe = load_recipe(write_recipe(tmp_path, budgets={"transient_mib": 64, "retained_mib": 1}))
    encoder = CountingEncoder(clip)
    with pytest.raises(BudgetExceeded, match=r"data\.budgets\.retained_mib=1"):
        prepare_resolved(recipe, tmp_path / "out", host=host_module, encoder=encoder, progress=False)
    assert encoder.calls == 0


def test_transient_budget_stops_and_the_temporary_cache_is_removed(tmp_path, clip, host_module, monkeypatch):
    import stitch.data.prepare as prep

    seen: list[Path] = []
    real_open = prep.open_stream

    def open_and_download(source, cache_dir, builtin):  # stands in for a hub download landing in the temp cache
        seen.append(cache_dir)
        cache_dir.mkdir(parents=True, exist_ok=True)
        (cache_dir / "downloaded.bin").write_bytes(b"\0" * (2 * 2**20))
        return real_open(source, cache_dir, builtin)

    monkeypatch.setattr(prep, "open_stream", open_and_download)
    recipe = load_recipe(write_recipe(tmp_path, budgets={"transient_mib": 1, "retained_mib": 16}))
    with pytest.raises(BudgetExceeded, match=r"data\.budgets\.transient_mib=1"):
        prepare_resolved(recipe, tmp_path / "out", host=host_module, encoder=clip, progress=False)
    assert seen and not seen[0].exists()


def test_prepare_streams_through_its_own_temp_cache_and_never_the_global_one(tmp_path, clip, host_module, monkeypatch):
    import datasets

    global_cache = Path(datasets.config.HF_DATASETS_CACHE)
    before = sorted(global_cache.rglob("*")) if global_cache.exists() else None
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))  # so other processes' runs cannot interfere
    opened: list[Path] = []
    import stitch.data.prepare as prep

    real_open = prep.open_stream
    monkeypatch.setattr(prep, "open_stream", lambda source, cache, builtin: opened.append(cache) or real_open(source, cache, builtin))
    recipe = load_recipe(write_recipe(tmp_path))
    prepare_resolved(recipe, tmp_path / "out", host=host_module, encoder=clip, progress=False)
    after = sorted(global_cache.rglob("*")) if global_cache.exists() else None
    assert after == before
    assert opened and opened[0].is_relative_to(private_tmp)  # the datasets cache lived in prepare's temp dir
    assert list(private_tmp.iterdir()) == []  # ... which is gone


def test_scan_cap_reached_before_partitions_fill_is_an_error_naming_the_cap(tmp_path, host_module):
    source = {"path": str(_corrupt_parquet(tmp_path)), "format": "parquet"}
    recipe = load_recipe(
        write_recipe(tmp_path, source=source, partitions={"train": [0, 12]}, scan_cap=12, on_corrupt="skip")
    )
    with pytest.raises(PrepareError, match=r"data\.scan_cap=12"):
        prepare_resolved(recipe, tmp_path / "out", host=host_module, progress=False)


def test_shipped_demo_recipe_prepares_with_its_own_columns_dtype_and_encoder(tmp_path, host_module):
    demo = load_recipe("demo", host_module)
    for kind, name in (("models", demo.model), ("encoders", demo.encoder), ("projectors", demo.projector)):
        host_module.get(kind, name)
    # the same recipe, shrunk to its first 32 rows, keeps every data setting but the row count (its annotator
    # labels the shrunk SFT rows); prepare reads the demo base's tokenizer without building its weights
    small_source = dataclasses.replace(demo.data.source, rows=32, caption_rows=8, annotator_rows=(8, 32))
    parts = (dataclasses.replace(demo.data.partitions[0], end=8), dataclasses.replace(demo.data.partitions[1], start=8, end=32))
    small = dataclasses.replace(demo, data=dataclasses.replace(demo.data, source=small_source, partitions=parts))
    report = prepare_resolved(small, tmp_path / "out", host=host_module, progress=False)
    assert report.rows == {"alignment": 8, "train": 24}
    encoder = host_module.get("encoders", demo.encoder)
    assert report.retained_bytes_per_row <= 1.05 * encoder.tokens_per_item * encoder.feature_width * 2


def test_cli_prepare_accepts_a_recipe_file_path_and_prints_the_report(tmp_path):
    from typer.testing import CliRunner

    from stitch.cli import app

    recipe = write_recipe(tmp_path, source={"builtin": "counting-shapes", "rows": 12, "seed": 1},
                          partitions={"train": [0, 12]})
    result = CliRunner().invoke(app, ["prepare", "--recipe", str(recipe), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "retained per row" in result.output and "train=12" in result.output
    assert (tmp_path / "out" / MANIFEST_NAME).is_file()


def test_cli_prepare_reports_a_bad_recipe_field_without_a_traceback(tmp_path):
    recipe = write_recipe(tmp_path, on_corrupt="ignore")
    result = subprocess.run([sys.executable, "-m", "stitch", "prepare", "--recipe", str(recipe), "--out",
                             str(tmp_path / "out")], capture_output=True, text=True)
    assert result.returncode == 2  # the input class, as `train` and `run` report the same recipe (docs/errors.md)
    assert "data.on_corrupt" in result.stderr and "'ignore'" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def _write_images(folder: Path, n: int) -> list[str]:
    from stitch.demo.data import make_rows

    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for row in make_rows(n, seed=5):
        name = f"{row['id']}.png"
        (folder / name).write_bytes(row["image"]["bytes"])
        names.append(name)
    return names


def test_json_source_with_chat_messages_and_two_images_per_row(tmp_path, clip, host_module):
    names = _write_images(tmp_path / "data" / "images", 6)
    with open(tmp_path / "data" / "rows.jsonl", "w") as handle:
        for i in range(3):
            conversations = [
                {"from": "human", "value": "Which image has more objects?"},
                {"from": "gpt", "value": "The first."},
            ]
            pair = [f"images/{names[2 * i]}", f"images/{names[2 * i + 1]}"]  # relative to the data file
            handle.write(json.dumps({"uid": f"pair-{i}", "images": pair, "conversations": conversations}) + "\n")
    recipe = load_recipe(write_recipe(
        tmp_path,
        source={"path": "data/rows.jsonl", "format": "json"},
        columns={"id": "uid", "media": "images", "messages": "conversations"},
        partitions={"train": [0, 3]},
        scan_cap=3,
    ))
    prepare_resolved(recipe, tmp_path / "out", host=host_module, encoder=clip, progress=False)
    data = PreparedData(tmp_path / "out")
    rows = list(data.rows())
    assert [r.id for r in rows] == ["pair-0", "pair-1", "pair-2"]
    assert rows[1].messages[0] == {"role": "user", "content": "Which image has more objects?"}
    assert rows[1].messages[1]["role"] == "assistant"
    assert [k.index for k in rows[1].features] == [2, 3] and rows[1].num_items == 2
    assert data.features(rows[1]).shape == (2, TOKENS, WIDTH)


def test_imagefolder_source_with_metadata_and_positional_row_ids(tmp_path, clip, host_module):
    names = _write_images(tmp_path / "folder", 4)
    with open(tmp_path / "folder" / "metadata.jsonl", "w") as handle:
        for name in names:
            handle.write(json.dumps({"file_name": name, "q": "How many objects are in the image?", "a": "3"}) + "\n")
    recipe = load_recipe(write_recipe(
        tmp_path,
        source={"path": str(tmp_path / "folder"), "format": "imagefolder"},
        columns={"media": "image", "question": "q", "answer": "a"},
        partitions={"train": [1, 4]},
        scan_cap=4,
    ))
    report = prepare_resolved(recipe, tmp_path / "out", host=host_module, encoder=clip, progress=False)
    rows = list(PreparedData(tmp_path / "out").rows())
    assert [r.id for r in rows] == ["row1", "row2", "row3"] and report.rows_scanned == 4
    assert rows[0].provenance["dataset"] == f"imagefolder:{tmp_path / 'folder'}"


def test_manifest_lines_are_the_json_of_each_rows_manifest_row_byte_for_byte():
    from stitch.data.feature_cache import FeatureKey, ManifestLines, ManifestRow

    provenance = {"encoder": "clip-tiny", "encoder_id": "tiny:clip", "encoder_revision": None,
                  "dataset": "json:/data/ünï.jsonl"}
    lines = ManifestLines(49, 768, "bfloat16", provenance)
    rows = [
        ManifestRow("r0", "train", ({"role": "user", "content": "Wie viele? <|im_end|>"},
                                    {"role": "assistant", "content": "drei \"3\"\n"}),
                    (FeatureKey("a.safetensors", 0, "f" * 64), FeatureKey("a.safetensors", 1, None)),
                    49, 768, "bfloat16", provenance, {"rejected": "vier"}),
        ManifestRow("r1", "eval", ({"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}),
                    (FeatureKey("b.safetensors", 7, "e" * 64),), 49, 768, "bfloat16", provenance, {}),
    ]
    for row in rows:
        want = json.dumps(row.as_json(), ensure_ascii=False, separators=(",", ":")) + "\n"
        assert lines.line(row.id, row.partition, row.messages, row.features, row.extra) == want
        assert ManifestRow.from_json(json.loads(want)) == row
    other = ManifestLines(49, 256, "bfloat16", provenance)  # the shared fields are the ones given
    assert other.line("r1", "eval", rows[1].messages, rows[1].features) != lines.line(
        "r1", "eval", rows[1].messages, rows[1].features)


def test_stream_rows_read_in_batches_are_the_rows_the_stream_yields_one_by_one(tmp_path):
    from datasets import Image, load_dataset

    from stitch.data.prepare import stream_rows

    with open(tmp_path / "rows.jsonl", "w") as fh:
        for i in range(10):
            fh.write(json.dumps({"id": f"r{i}", "image": f"imgs/{i}.png", "tags": ["a"] * (i % 3),
                                 "question": f"q {i}", "answer": i}) + "\n")
    stream = load_dataset("json", data_files=str(tmp_path / "rows.jsonl"), split="train", streaming=True,
                          cache_dir=str(tmp_path / "cache"))
    stream = stream.cast_column("image", Image(decode=False))
    one_by_one = list(stream)
    assert one_by_one[3]["image"] == {"bytes": None, "path": "imgs/3.png"}
    assert list(stream_rows(stream, batch_size=4)) == one_by_one  # 10 rows: batches of 4, 4 and 2
    assert list(stream_rows(iter(one_by_one))) == one_by_one  # a plain iterable of rows passes through
    assert list(stream_rows(stream, batch_size=4))[:3] != one_by_one[1:4]  # order counts: the check can fail


def test_no_shard_queued_behind_a_failed_encode_is_encoded_or_written(tmp_path, clip, host_module):
    """The encode thread fails on shard 3 only once shard 4 is already queued behind it: shard 4 is not encoded and
    not written, so the cache holds exactly the shards finished in order, as a synchronous run would leave it."""
    import threading

    from stitch.data import prepare as prep

    recipe = load_recipe(write_recipe(tmp_path))  # 4 shards of 12 rows, encoded in batches of 6
    fourth_queued = threading.Event()
    killed = CountingEncoder(clip, fail_on_call=5)  # the first call of shard 3
    encode = killed.encode

    def waiting_encode(items):
        if killed.calls == 4:  # this call is the fifth: shard 3's first
            assert fourth_queued.wait(timeout=30), "shard 4 was never queued"
        return encode(items)

    killed.encode = waiting_encode
    original = prep._Preparation.record

    def record(self, manifest, keep=0):
        if self.shards_encoded == 4:  # flush has queued shard 4's encode
            fourth_queued.set()
        return original(self, manifest, keep)

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(prep._Preparation, "record", record)
        with pytest.raises(Killed):
            prepare_resolved(recipe, tmp_path / "out", host=host_module, encoder=killed, progress=False)
    finally:
        mp.undo()
    assert killed.calls == 5  # shards 1-2 (4 calls), then shard 3's failing one: nothing after it
    assert len(list((tmp_path / "out" / CACHE_DIRNAME).glob("*.safetensors"))) == 2
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()
