"""GRPO you can see into: completions.jsonl rows of what was sampled and how it scored, the end-of-run completion
table, and one "no learning signal" warning when every group scored alike for `flat_reward_steps` steps."""

from __future__ import annotations

import itertools
import json
import logging
import shutil
from pathlib import Path

from stitch.config.recipe import load_recipe
from stitch.host.host import get_host
from stitch.plugins.specs import TaskSpec
from stitch.stages.loop import run_stage
from stitch.stages.rollout_log import (
    MAX_ROWS_PER_STEP,
    MAX_TEXT_CHARS,
    CompletionLog,
    CompletionRecord,
    SignalWatch,
    flat_groups,
    hit_length_cap,
)
from tests.stitch_testing import write_recipe

COLUMNS = {"step", "prompt_id", "group", "completion", "tokens", "rewards", "advantage", "hit_max_new_tokens"}


def _record(step: int, text: str = "The answer is 3.") -> CompletionRecord:
    return CompletionRecord(step, "r1", 0, text, 5, {"counting": 1.0}, 0.5, False)


def test_flat_groups_is_true_only_when_every_group_scored_alike():
    assert flat_groups([0.0, 0.0, 1.0, 1.0], 2)
    assert not flat_groups([0.0, 0.0, 1.0, 0.0], 2)


def test_hit_length_cap_tells_a_cut_completion_from_one_ended_by_eos():
    assert hit_length_cap([5, 6, 7], 3, eos_id=2)
    assert not hit_length_cap([5, 6, 2], 3, eos_id=2)
    assert not hit_length_cap([5, 6], 3, eos_id=2)


def test_completion_log_bounds_rows_and_text_and_cuts_back_on_resume(tmp_path):
    log = CompletionLog(tmp_path / "completions.jsonl", every=2)
    assert [s for s in range(1, 6) if log.due(s)] == [2, 4]
    log.write([_record(2, "x" * (MAX_TEXT_CHARS + 100))] * (MAX_ROWS_PER_STEP + 5))
    log.write([_record(4)])
    rows = log.read()
    assert len(rows) == MAX_ROWS_PER_STEP + 1 and len(rows[0]["completion"]) == MAX_TEXT_CHARS
    assert log.last_step_table() == [rows[-1]]
    log.truncate_after(3)
    assert {r["step"] for r in log.read()} == {2}
    assert not CompletionLog(tmp_path / "never.jsonl", every=0).due(4)


def test_signal_watch_warns_once_after_patience_flat_steps_and_a_varied_step_restarts_the_count(caplog):
    watch = SignalWatch(2, Path("completions.jsonl"))
    with caplog.at_level(logging.WARNING, logger="stitch"):
        assert [watch.observe(s, flat, 0.5) for s, flat in enumerate([True, False, True, True, True], 1)] == [
            False, False, False, True, False]
    assert len(caplog.records) == 1
    assert "no learning signal" in caplog.text and "50% of this step's completions hit max_new_tokens" in caplog.text
    assert watch.longest == 3


def _grpo(sft_run: Path, tmp_path: Path, monkeypatch, reward) -> tuple[dict, Path]:
    run = tmp_path / "run"
    shutil.copytree(sft_run, run)
    monkeypatch.setattr("stitch.stages.grpo.resolve_task",
                        lambda recipe, registry: TaskSpec(name="probe", reward=reward))
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", stages__grpo__steps=3, stages__grpo__group_size=4,
                                      stages__grpo__temperature=1.5, stages__grpo__flat_reward_steps=2,
                                      stages__grpo__save_every=3))
    return run_stage(recipe, "grpo", run, progress=False, registry=get_host()), run


def test_grpo_with_an_always_zero_reward_warns_once_and_logs_every_completion(sft_run, tmp_path, monkeypatch,
                                                                                caplog):
    with caplog.at_level(logging.WARNING, logger="stitch"):
        summary, run = _grpo(sft_run, tmp_path, monkeypatch, lambda completion, row: 0.0)
    warnings = [r.getMessage() for r in caplog.records if "no learning signal" in r.getMessage()]
    assert len(warnings) == 1 and "grpo step 2:" in warnings[0] and "completions.jsonl" in warnings[0]
    rows = [json.loads(line) for line in (run / "grpo" / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 2 * 4  # every step (log_every 1): 2 prompts x 4 completions
    assert all(set(r) == COLUMNS for r in rows)
    assert {r["rewards"]["probe"] for r in rows} == {0.0} and {r["advantage"] for r in rows} == {0.0}
    assert all(r["tokens"] > 0 and isinstance(r["completion"], str) for r in rows)
    assert summary["flat_reward_steps_max"] == 3
    assert summary["completion_table"] == rows[-8:]  # the last step's completions, in the end-of-run summary


def test_grpo_whose_groups_score_differently_does_not_warn(sft_run, tmp_path, monkeypatch, caplog):
    # the reward alternates 0, 1, 0, 1 over its calls: every group of 4 scores differently, whatever was sampled
    calls = itertools.count()
    with caplog.at_level(logging.WARNING, logger="stitch"):
        summary, run = _grpo(sft_run, tmp_path, monkeypatch, lambda completion, row: float(next(calls) % 2))
    assert "no learning signal" not in caplog.text
    assert summary["flat_reward_steps_max"] == 0
    rows = [json.loads(line) for line in (run / "grpo" / "completions.jsonl").read_text().splitlines()]
    assert len({r["rewards"]["probe"] for r in rows}) > 1


def test_grpo_log_every_zero_writes_no_completions_file(sft_run, tmp_path, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(sft_run, run)
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", stages__grpo__steps=1, stages__grpo__log_every=0))
    summary = run_stage(recipe, "grpo", run, progress=False, registry=get_host())
    assert not (run / "grpo" / "completions.jsonl").exists()
    assert summary["completions"] is None and summary["completion_table"] == []


