"""What produced a run is recorded with it: library versions and the git sha, in each stage's summary.json and
in every checkpoint."""

from __future__ import annotations

import importlib.metadata
import json


def test_stage_summary_and_checkpoint_record_library_versions_and_the_git_sha(sft_run):
    from stitch.runs.checkpoint import latest_step_dir

    summary = json.loads((sft_run / "sft" / "summary.json").read_text())
    state = json.loads((latest_step_dir(sft_run / "sft" / "checkpoints") / "trainer_state.json").read_text())
    for record in (summary["environment"], state["environment"]):
        assert record["versions"]["transformers"] == importlib.metadata.version("transformers")
        assert record["versions"]["torch"] == importlib.metadata.version("torch")
        assert record["versions"]["stitch-lm"] == importlib.metadata.version("stitch-lm")
        assert record["git_sha"] is None or len(record["git_sha"].split("-")[0]) == 40
