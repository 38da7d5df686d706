"""The grader's answer length and sampling are recipe options (eval_max_new_tokens, eval_temperature): a stage's
evaluation passes them on, and the answers are greedy at temperature 0, sampled from seeded generators above it."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import stitch.stages.evaluation as evaluation
import stitch.stages.loop as loop
from stitch.config.options import SFTOptions
from stitch.rollout.engines import Completion


def test_stage_evaluation_passes_the_recipes_answer_length_temperature_and_seed_to_the_grader(monkeypatch):
    seen = {}
    monkeypatch.setattr(loop, "evaluate_accuracy", lambda *args, **kwargs: seen.update(kwargs) or 0.5)
    opts = SFTOptions(eval_max_new_tokens=3, eval_temperature=0.7, seed=5, eval_rows=4)
    ctx = SimpleNamespace(dp=SimpleNamespace(full_parameters=lambda model: nullcontext()), model=None, session=None,
                          opts=opts)
    assert loop.StageContext.evaluate(ctx) == 0.5
    assert seen == {"limit": 4, "max_new_tokens": 3, "temperature": 0.7, "seed": 5}


class RecordingEngine:
    def __init__(self) -> None:
        self.calls: list[dict] = []

    def generate(self, embeds, n, max_new_tokens, temperature=1.0, greedy=False, seed=None):
        self.calls.append({"n": n, "max_new_tokens": max_new_tokens, "temperature": temperature, "greedy": greedy,
                           "seed": seed})
        return [Completion(i, [7], [0.0]) for i in range(len(embeds))]


def test_answers_are_greedy_at_temperature_zero_and_seeded_samples_above_it(monkeypatch):
    monkeypatch.setattr(evaluation, "prompt_embeddings", lambda payload, model, prompts, zero_features: prompts)
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: f"tokens {ids}")
    engine = RecordingEngine()
    prompts = [("a", [1], None), ("b", [2], None)]
    assert evaluation.sampled_answers(None, None, engine, tokenizer, prompts, 5) == ["tokens [7]"] * 2
    evaluation.sampled_answers(None, None, engine, tokenizer, prompts, 6, temperature=0.8, seed=11)
    assert engine.calls == [
        {"n": 1, "max_new_tokens": 5, "temperature": 1.0, "greedy": True, "seed": None},
        {"n": 1, "max_new_tokens": 6, "temperature": 0.8, "greedy": False, "seed": 11},
    ]
