"""lmms-eval 0.7.3's `openai` model against `stitch serve` on the tiny demo checkpoint, on a task shipped as a local
fixture (tests/fixtures/lmms_eval/stitch_counting: a task YAML and 8 held-out rows), with the hub offline: its score
equals stitch's own grader on `stitch infer`'s answers to the same rows, and its logged answers are those answers.

lmms-eval runs in its own interpreter (it needs filelock < 3.21; the test venv has a newer one): .ci/run builds it
as .venv-lmms-eval; ``STITCH_LMMS_EVAL_PYTHON`` names another."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from stitch.host.host import get_host
from stitch.plugins.specs import TaskRow
from tests.stitch_testing import start_server

TASK_DIR = Path(__file__).parents[1] / "fixtures" / "lmms_eval" / "stitch_counting"
LMMS_PYTHON = Path(os.environ.get("STITCH_LMMS_EVAL_PYTHON", Path(__file__).parents[2] / ".venv-lmms-eval/bin/python"))
MAX_NEW = 12  # the task YAML's max_new_tokens

pytestmark = pytest.mark.skipif(
    not LMMS_PYTHON.exists() or subprocess.run([str(LMMS_PYTHON), "-c", "import lmms_eval"]).returncode != 0,
    reason=f"lmms-eval is not installed at {LMMS_PYTHON} (.ci/run builds it; docs/ecosystem.md)")


def fixture_rows() -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(TASK_DIR / "rows.parquet").to_pylist()


@pytest.fixture(scope="module")
def lmms_eval_run(sft_run, tmp_path_factory) -> dict:
    """One lmms-eval run of the fixture task against the served checkpoint: its results and its logged samples."""
    out = tmp_path_factory.mktemp("lmms-eval")
    proc, port = start_server(sft_run, "--model-name", "tiny", env={**os.environ, "OMP_NUM_THREADS": "1"})
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(out / "hf"),
               "OPENAI_API_KEY": "unused", "PYTHONPATH": ""}
    try:
        done = subprocess.run(
            [str(LMMS_PYTHON), "-m", "lmms_eval", "--model", "openai", "--model_args",
             f"model_version=tiny,base_url=http://127.0.0.1:{port}/v1,num_concurrent=8,max_retries=1",
             "--tasks", "stitch_counting", "--include_path", str(TASK_DIR), "--batch_size", "8",
             "--output_path", str(out / "results"), "--log_samples"],
            cwd=TASK_DIR, env={**os.environ, **offline}, capture_output=True, text=True, timeout=600)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert done.returncode == 0, done.stderr[-4000:]
    (results,) = (out / "results").glob("*/*_results.json")
    (samples,) = (out / "results").glob("*/*_samples_stitch_counting.jsonl")
    return {"results": json.loads(results.read_text()),
            "samples": sorted((json.loads(line) for line in samples.read_text().splitlines()),
                              key=lambda s: s["doc_id"])}


@pytest.fixture(scope="module")
def stitched(sft_run):
    from stitch.serve.inference import Stitched

    return Stitched(sft_run / "sft" / "checkpoints", registry=get_host())


@pytest.fixture(scope="module")
def stitch_answers(stitched) -> list[str]:
    """`stitch infer`'s greedy answers to the fixture rows, at the task's generation length."""
    return [stitched.answer(row["image"], row["question"], max_new_tokens=MAX_NEW) for row in fixture_rows()]


def test_lmms_eval_score_on_the_local_task_equals_stitchs_grader_on_the_same_rows(lmms_eval_run, stitch_answers):
    task = get_host().get("tasks", "counting")
    rows = fixture_rows()
    graded = [task.score(answer, TaskRow(id=row["id"], question=row["question"], answer=row["answer"]))
              for answer, row in zip(stitch_answers, rows, strict=True)]
    score = lmms_eval_run["results"]["results"]["stitch_counting"]["acc,none"]
    assert len(lmms_eval_run["samples"]) == len(rows) == 8
    assert score == pytest.approx(sum(graded) / len(graded)), (score, graded, stitch_answers)


def test_lmms_eval_logged_answers_and_prompt_tokens_are_stitch_infers_for_every_row(lmms_eval_run, stitch_answers,
                                                                                    stitched):
    """Its answers are `stitch infer`'s, and each prompt it sent is stitch's: the image's soft tokens (49) and the
    question, token for token in number (the tiny model may answer every image alike; the prompt length still
    fails when the image does not arrive)."""
    samples = lmms_eval_run["samples"]
    assert [s["filtered_resps"].strip() for s in samples] == [a.strip() for a in stitch_answers]
    expected = [len(stitched.binding.prompt_ids(row["question"], stitched.encode(row["image"]).shape[0]))
                for row in fixture_rows()]
    assert [s["token_counts"][0]["input_tokens"] for s in samples] == expected
