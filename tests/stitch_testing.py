"""Helpers shared by the stage tests: small recipes written to disk and prepared once per session."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import yaml

BASE: dict[str, Any] = {
    "name": "small",
    "model": "qwen3.5-demo",
    "encoder": "clip-tiny",
    "projector": "mlp2x_gelu",
    "task": "counting",  # the demo's task: its reward, grader and DPO pairs (the next integer)
    "data": {
        "source": {"builtin": "counting-shapes", "rows": 120, "caption_rows": 20, "seed": 0},
        "columns": {"id": "id", "media": "image", "question": "question", "answer": "answer"},
        "partitions": {"alignment": [0, 20], "train": [20, 80], "eval": [80, 100], "grpo": [100, 120]},
        "scan_cap": 200,
        "budgets": {"transient_mib": 512, "retained_mib": 64},
        "feature_dtype": "float16",
    },
    "stages": {
        "alignment": {"partition": "alignment", "eval_partition": None, "steps": 2, "batch_size": 2,
                      "save_every": 2},
        "sft": {"partition": "train", "eval_partition": None, "steps": 2, "batch_size": 2, "save_every": 2},
        "grpo": {"partition": "grpo", "eval_partition": None, "steps": 2, "prompts_per_step": 2, "group_size": 2,
                 "save_every": 1},
        "dpo": {"partition": "train", "eval_partition": None, "steps": 2, "pairs_per_step": 2, "save_every": 1},
    },
}


def write_recipe(path: Path, **overrides: Any) -> Path:
    """BASE with dotted-path overrides (``stages__sft__steps=6``), written as YAML."""
    recipe = copy.deepcopy(BASE)
    for key, value in overrides.items():
        node = recipe
        *parents, leaf = key.split("__")
        for part in parents:
            node = node[part]
        node[leaf] = value
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def copy_prepared(src_run: Path, dst_run: Path) -> None:
    shutil.copytree(src_run / "data", dst_run / "data")
