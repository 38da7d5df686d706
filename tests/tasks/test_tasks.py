"""Tasks: registered names and user rewards given as ``module:function`` or a file outside the repo resolve to the
TaskSpec the stages call; a task that cannot work is refused at load naming the field; the generic graders."""

from __future__ import annotations

import copy
import json
import random
import shutil
import textwrap
from pathlib import Path

import pytest
import yaml

from stitch.config.recipe import RecipeError, load_recipe
from stitch.host.host import get_host
from stitch.host.validate import validate_recipe
from stitch.plugins.specs import TaskRow
from stitch.stages.loop import run_stage
from stitch.tasks import check_task, majority_baseline, resolve_task, scorer_name
from stitch.tasks.generic import contains_answer, exact_match, normalise_answer
from tests.stitch_testing import BASE, write_recipe

REPO = Path(__file__).resolve().parents[2]
# a user reward without a rejected column leaves DPO without pairs (refused at load): these recipes drop DPO
def no_dpo() -> dict:
    return {name: copy.deepcopy(opts) for name, opts in BASE["stages"].items() if name != "dpo"}


def _row(answer: str, **extra) -> TaskRow:
    return TaskRow("r0", "What color is the circle?", answer, extra)


# -- generic graders -------------------------------------------------------------------------------------


@pytest.mark.parametrize("completion", ["red", "Red.", "  RED  ", '"red"', "red!", "red\n", "(red)"])
def test_exact_match_ignores_case_whitespace_quotes_and_trailing_punctuation(completion):
    assert exact_match(completion, _row("red")) == 1.0


@pytest.mark.parametrize("completion", ["dark red", "redd", "blue", "", "red and blue"])
def test_exact_match_refuses_other_words(completion):
    assert exact_match(completion, _row("red")) == 0.0


def test_normalise_answer_collapses_inner_whitespace_and_keeps_inner_punctuation():
    assert normalise_answer("  The   answer\tis 3.  ") == "the answer is 3"
    assert normalise_answer("U.S.A.") == "u.s.a"


def test_contains_matches_whole_words_only():
    assert contains_answer("The shape is red.", _row("red")) == 1.0
    assert contains_answer("The shape is reddish.", _row("red")) == 0.0


def test_majority_baseline_is_the_score_of_always_giving_the_most_frequent_answer(host):
    task = host.get("tasks", "exact-match")
    rows = [_row(a) for a in ("red", "blue", "red", "green", "Red.")]
    # "red" and "Red." grade equal under exact-match: the baseline answer scores on 3 of 5 rows
    assert majority_baseline(task, rows) == {"answer": "red", "accuracy": 0.6, "rows": 5}


# -- registered tasks ------------------------------------------------------------------------------------


def test_core_registers_generic_tasks_and_the_demo_registers_counting_and_color_naming(host):
    assert {"exact-match", "contains", "counting", "color-naming"} <= set(host.names("tasks"))


def test_recipe_without_a_task_is_graded_by_exact_match(tmp_path, host):
    path = write_recipe(tmp_path / "r.yaml", stages={})
    mapping = yaml.safe_load(path.read_text())
    del mapping["task"]
    path.write_text(yaml.safe_dump(mapping))
    recipe = load_recipe(path)
    assert resolve_task(recipe, host).name == "exact-match"


def test_color_naming_rejects_the_answer_with_another_palette_colour_drawn_from_the_stage_rng(host):
    task = host.get("tasks", "color-naming")
    right = _row("The answer is red.")
    wrong = {task.rejected(right, random.Random(seed)) for seed in range(40)}
    assert len(wrong) > 1 and all(w.startswith("The answer is ") and "red" not in w for w in wrong)
    assert task.reward("the answer is RED", right) == 1.0 and task.reward("The answer is blue.", right) == 0.0
    caption = TaskRow("c", "Describe the image.", "There is 1 object: a small red circle.")
    assert task.takes(right) and not task.takes(caption)


def test_shipped_recipes_name_their_demo_tasks(host):
    assert resolve_task(load_recipe("demo", host), host).name == "counting"
    assert resolve_task(load_recipe("demo-colors", host), host).name == "color-naming"


# -- user rewards ----------------------------------------------------------------------------------------


def _reward_file(folder: Path, body: str, name: str = "rewards.py") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(textwrap.dedent(body))
    return path


def test_reward_from_a_file_outside_the_repo_resolves_relative_to_the_recipe_directory(tmp_path, host):
    outside = tmp_path / "elsewhere"
    assert REPO not in outside.parents
    _reward_file(outside, """
        def likes_blue(completion, row):
            return 1.0 if "blue" in completion else 0.0

        def strict(completion, row):
            return float(completion == row.answer)
    """)
    recipe_dir = tmp_path / "recipes"
    recipe_dir.mkdir()
    # relative to the recipe's directory, not the working directory
    recipe = load_recipe(write_recipe(recipe_dir / "r.yaml", task={"reward": "../elsewhere/rewards.py:likes_blue",
                                                                   "grade": "../elsewhere/rewards.py:strict"},
                                      stages=no_dpo()))
    task = check_task(recipe, host)
    assert task.reward("a blue square", _row("red")) == 1.0 and task.reward("red", _row("red")) == 0.0
    assert task.score("red", _row("red")) == 1.0  # grade, not reward, scores evaluation
    assert task.rejected is None  # a user task takes DPO pairs from the dataset's rejected column


def test_reward_given_as_an_importable_module_function(tmp_path, host):
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", task={"reward": "stitch.tasks.generic:contains_answer"}))
    assert resolve_task(recipe, host).reward is contains_answer


BAD_REWARDS = {
    "missing module": ("no_such_module_xyz:reward", r"cannot import module 'no_such_module_xyz'.*'reward'"),
    "missing file": ("missing/rewards.py:reward", r"file .*missing/rewards\.py.* does not exist"),
    "missing function": ("rewards.py:nope", r"file 'rewards\.py' has no function 'nope'"),
    "not callable": ("rewards.py:THRESHOLD", r"'THRESHOLD' in file 'rewards\.py' is not callable"),
    "wrong signature": ("rewards.py:one_arg", r"'one_arg' in file 'rewards\.py' cannot be called as \(completion, row\)"),
    "no function part": ("rewards.py", r"expected 'module:function'"),
    "import fails": ("broken.py:reward", r"importing file .*broken\.py.* failed \(ZeroDivisionError"),
}


@pytest.mark.parametrize("case", sorted(BAD_REWARDS))
def test_bad_reward_is_refused_at_load_naming_the_field_the_module_and_the_function(tmp_path, monkeypatch, case):
    _reward_file(tmp_path, """
        THRESHOLD = 3

        def one_arg(completion):
            return 1.0
    """)
    _reward_file(tmp_path, "1 / 0\n", "broken.py")
    target, message = BAD_REWARDS[case]

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the task was checked")

    monkeypatch.setattr("stitch.model.loading.load_model", no_load)
    with pytest.raises(RecipeError, match=r"field 'task\.reward'") as caught:  # at load (form) or validation
        validate_recipe(load_recipe(write_recipe(tmp_path / "r.yaml", task={"reward": target})), get_host())
    assert caught.match(message)


def test_bad_grade_is_refused_naming_task_grade(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", task={"reward": "stitch.tasks.generic:exact_match",
                                                                 "grade": "stitch.tasks.generic:nope"}))
    with pytest.raises(RecipeError, match=r"field 'task\.grade'.*module 'stitch\.tasks\.generic' has no function 'nope'"):
        validate_recipe(recipe, get_host())


def test_unknown_task_name_is_refused_listing_the_registered_tasks(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", task="no-such-task"))
    with pytest.raises(RecipeError, match=r"field 'task'.*no-such-task.*exact-match"):
        validate_recipe(recipe, get_host())


def test_dpo_without_a_pair_source_is_refused_at_load_naming_data_columns_rejected(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", task="exact-match"))
    with pytest.raises(RecipeError, match=r"stage 'dpo' needs preference pairs.*'data\.columns\.rejected'"):
        validate_recipe(recipe, get_host())


def test_task_with_both_name_and_reward_is_refused(tmp_path):
    with pytest.raises(RecipeError, match=r"'task'.*exactly one of 'name' or 'reward'"):
        load_recipe(write_recipe(tmp_path / "r.yaml", task={"name": "counting", "reward": "m:f"}))


# -- the task is what GRPO rewards with ------------------------------------------------------------------


def test_grpo_logs_the_reward_of_a_user_function_from_a_file_outside_the_repo(sft_run, tmp_path):
    calls = tmp_path / "calls.jsonl"
    _reward_file(tmp_path / "user", f"""
        import json

        def only_blue(completion, row):
            # 1.0 only for a word the tiny counting model never says: GRPO must log exactly 0.0 with this
            # reward, and exactly 1.0 with its negation, whatever the samples are
            with open({str(calls)!r}, "a") as handle:
                handle.write(json.dumps({{"row": row.id, "completion": completion}}) + "\\n")
            return 1.0 if "blue" in completion else 0.0

        def not_blue(completion, row):
            return 1.0 - only_blue(completion, row)
    """)
    logged = {}
    for fn in ("only_blue", "not_blue"):
        run = tmp_path / fn / "run"
        shutil.copytree(sft_run, run)
        recipe = load_recipe(write_recipe(tmp_path / fn / "r.yaml", task={"reward": f"../user/rewards.py:{fn}"},
                                          stages=no_dpo(), stages__grpo__steps=1))
        validate_recipe(recipe, get_host())
        run_stage(recipe, "grpo", run, registry=get_host(), progress=False)
        logged[fn] = [json.loads(line)["reward"] for line in (run / "grpo" / "metrics.jsonl").read_text().splitlines()]
    seen = [json.loads(line) for line in calls.read_text().splitlines()]
    assert not any("blue" in s["completion"] for s in seen)
    assert logged == {"only_blue": [0.0], "not_blue": [1.0]}
    # one call per sampled completion (2 prompts x 2 samples per run), on rows of the grpo partition
    assert len(seen) == 2 * 2 * 2 and all(s["row"].startswith("shapes-0-") for s in seen)


def test_evaluation_grades_with_the_task_grader_on_the_rows_the_task_accepts(sft_run, tmp_path):
    from stitch.stages.evaluation import evaluate_accuracy
    from stitch.stages.session import StitchSession

    graded = tmp_path / "graded.jsonl"
    _reward_file(tmp_path / "user", f"""
        import json

        def reward(completion, row):
            return 0.0

        def grade(completion, row):
            with open({str(graded)!r}, "a") as handle:
                handle.write(json.dumps({{"row": row.id, "answer": row.answer}}) + "\\n")
            return 0.25
    """)
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", stages=no_dpo(),
                                      task={"reward": "user/rewards.py:reward", "grade": "user/rewards.py:grade"}))
    session = StitchSession.open(recipe, sft_run, registry=get_host())
    step = Path(json.loads((sft_run / "sft" / "summary.json").read_text())["checkpoint"])
    model = session.binding.build_model(adapter_from=step / "adapter", projector_from=step / "projector")
    assert evaluate_accuracy(session, model, "eval", limit=5) == 0.25
    seen = [json.loads(line) for line in graded.read_text().splitlines()]
    eval_ids = [r.id for r in session.data.rows("eval")]
    assert [s["row"] for s in seen] == eval_ids[:5]
    # the counting task takes no caption row: the alignment partition has none it can grade
    counting = StitchSession.open(load_recipe(write_recipe(tmp_path / "c.yaml")), sft_run, registry=get_host())
    with pytest.raises(ValueError, match="no rows that task 'counting' can grade"):
        evaluate_accuracy(counting, model, "alignment", limit=5)


def test_scorer_name_says_whether_evaluation_scores_come_from_a_grader_or_the_reward(tmp_path, host):
    def named(task) -> str:
        recipe = load_recipe(write_recipe(tmp_path / "r.yaml", task=task, stages=no_dpo()))
        return scorer_name(recipe, resolve_task(recipe, host))

    assert named("counting") == "the reward of task 'counting'"
    assert named({"reward": "stitch.tasks.generic:contains_answer"}) == (
        "reward stitch.tasks.generic:contains_answer (no grader given)")
    assert named({"reward": "stitch.tasks.generic:contains_answer", "grade": "stitch.tasks.generic:exact_match"}) == (
        "grader stitch.tasks.generic:exact_match")
