"""benchmarks/bench.py on CPU with the tiny presets: the sft and real-size suites run the product end to end and
write their JSON with every headline figure a positive number (a broken suite fails here, not on the GPU); the
result files name the commit the caller gives and keep the table out of benchmarks/results/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import common
from benchmarks.suites import SUITES

ROOT = Path(__file__).resolve().parents[2]


def bench(tmp_path: Path, *argv: str) -> dict:
    proc = subprocess.run([sys.executable, "benchmarks/bench.py", *argv, "--shape", "tiny", "--out",
                           str(tmp_path / "out"), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / "out" / f"{argv[0]}.json").read_text())


def positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


@pytest.mark.slow
def test_the_sft_suite_writes_positive_stitch_stock_and_llava_figures_and_a_results_table(tmp_path):
    result = bench(tmp_path, "sft", "--steps", "2", "--warmup", "1")
    for mode in ("stitch", "stock", "llava"):
        assert positive(result[mode]["tokens_per_s"]) and positive(result[mode]["tokens_per_step"]), mode
    assert positive(result["ratios"]["stitch_vs_stock"]) and positive(result["ratios"]["stitch_vs_llava"])
    flops = result["model"]["flops_per_token"]
    assert 0 < flops["lora"] < flops["6n"]  # frozen weights have no weight-gradient GEMM
    assert result["machine"]["torch"] and result["command"] and result["utc"]
    table = (tmp_path / "out" / "RESULTS.md").read_text()
    assert "| sft | tiny |" in table


@pytest.mark.slow
def test_the_real_size_suite_runs_snapshot_prepare_sft_and_grpo_on_a_narrowed_moe(tmp_path):
    result = bench(tmp_path, "real-size", "--steps", "1", "--warmup", "1")
    model = result["models"]["qwen3.6-35b-a3b"]
    assert positive(model["sft"]["tokens_per_s"]) and positive(model["grpo"]["step_s"])
    assert positive(model["grpo"]["rollout_tokens"])
    assert 0 < model["params"]["active"] < model["params"]["matmul_total"]  # routed experts count top-k of E


def test_a_result_records_the_commit_the_caller_gives_over_the_copys_git_metadata(tmp_path, monkeypatch):
    monkeypatch.setenv("STITCH_BENCH_COMMIT", "0123456789abcdef0123456789abcdef01234567")
    doc = json.loads(common.write_result("sft", {"rows": []}, tmp_path).read_text())
    assert doc["commit"] == "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.delenv("STITCH_BENCH_COMMIT")
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    assert common.commit().split("+")[0] == head


def test_the_table_goes_beside_the_results_folder_which_keeps_only_suite_jsons(tmp_path, monkeypatch):
    results = tmp_path / "benchmarks" / "results"
    monkeypatch.setattr(common, "RESULTS_DIR", results)
    monkeypatch.setattr(common, "RESULTS_TABLE", results.parent / "RESULTS.md")
    monkeypatch.setenv("STITCH_BENCH_COMMIT", "0123456789abcdef0123456789abcdef01234567+dirty")
    common.write_result("grpo", {"rows": [{"shape": "tiny", "figures": {"step s": 1.5}}]}, results)
    table = common.write_table(results)
    assert table == results.parent / "RESULTS.md"
    assert sorted(p.name for p in results.iterdir()) == ["grpo.json"]
    assert "| grpo | tiny | step s 1.5 | CPU | 0123456+dirty |" in table.read_text()


def test_the_committed_results_folder_holds_one_json_per_registered_suite_at_most():
    files = sorted(p.name for p in (ROOT / "benchmarks" / "results").iterdir())
    assert len(files) <= 10 and all(f.endswith(".json") and f[:-5] in SUITES for f in files), files
    assert (ROOT / "benchmarks" / "RESULTS.md").is_file()


def test_the_models_suite_keeps_the_models_an_earlier_call_measured_at_the_same_shape(tmp_path):
    """One GPU call per model fills one models.json: a later call keeps the entries it does not rerun, each with
    where it was measured; entries without that record, or of the other shape, are not carried."""
    from benchmarks.suites.models import earlier_models

    doc = {"config": {"shape": "dense4b"}, "models": {
        "qwen3.5-4b": {"sft": {"stitch_tokens_per_s": 1.0}, "measured": {"commit": "abc", "gpu": "H100"}},
        "nemotron-3-nano-4b": {"sft": {"stitch_tokens_per_s": 2.0}}}}
    path = tmp_path / "models.json"
    path.write_text(json.dumps(doc))
    assert list(earlier_models(path, tiny=False)) == ["qwen3.5-4b"]
    assert earlier_models(path, tiny=True) == {}
    assert earlier_models(tmp_path / "absent.json", tiny=False) == {}


def test_a_full_fine_tune_counts_the_lm_weights_once_as_trained_and_lora_counts_them_frozen():
    """The models suite's MFU: under LoRA the LM's matmuls are frozen (4 FLOPs a weight) beside the trained adapters
    and projector (6); under a full fine-tune the same matmuls are the trained ones (6), not frozen plus trained."""
    from benchmarks.suites.models import sft_flops

    active = 3_000
    lora = sft_flops(active, {"projector": 50, "adapter": 20, "lm": 0})
    assert lora == {"6n": 6 * 3_070, "lora": 4 * 3_000 + 6 * 70}
    full = sft_flops(active, {"projector": 50, "adapter": 0, "lm": 3_400})  # the lm group holds the embeddings too
    assert full == {"6n": 6 * 3_050, "lora": 6 * 3_050}


def test_a_models_call_cut_off_mid_model_leaves_the_figures_it_measured_in_models_json(tmp_path, monkeypatch):
    """A GPU call ends at its time limit: the stage figures a model measured before the cut are on disk already
    (written after each phase), and a model that then failed keeps them beside its error, marked cut off."""
    import argparse

    from benchmarks.suites import models

    sft = {"stitch_tokens_per_s": 10.0, "stock_tokens_per_s": None, "mfu_6n": 0.1, "mfu_lora": 0.05, "peak_gib": 1.0}
    seen_on_disk = []

    def one_model(name, args, save):
        save({"sft": sft, "grpo": {"generate_tokens_per_s": None}})
        seen_on_disk.append(json.loads((args.out / "models.json").read_text())["models"][name]["sft"])
        raise RuntimeError("stock ran out of time")

    monkeypatch.setattr(models, "one_model", one_model)
    args = argparse.Namespace(suite="models", shape="dense4b", models="qwen3.5-4b", train_lm="lora", out=tmp_path / "out")
    payload = models.run(args)
    assert seen_on_disk == [sft]
    entry = payload["models"]["qwen3.5-4b"]
    assert entry["sft"] == sft and entry["error"] == "RuntimeError: stock ran out of time"
    assert [row["shape"] for row in payload["rows"]] == ["qwen3.5-4b (cut off)"]
    assert "qwen3.5-4b (cut off)" in (tmp_path / "out" / "RESULTS.md").read_text()
