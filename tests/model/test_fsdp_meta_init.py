"""FSDP2 with meta-device init (parallel.meta_init, the default): under torchrun with 2 gloo ranks, rank 0 loads the
base model and rank 1 builds it with parameters on the meta device and receives only its shards; the losses equal
the path where every rank loads the whole model, and building the model costs rank 1 less host memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.stitch_testing import copy_prepared, write_recipe

# alignment under both paths in one launch (torchrun start-up costs 10-25 s here)
SCRIPT = """
import ctypes, ctypes.util, dataclasses, gc, json, sys
from pathlib import Path
import torch.distributed as dist
import stitch.host.host as plugin_host
import stitch.stages.distributed as distributed
from stitch.api import hookimpl
from stitch.config.recipe import load_recipe
from stitch.stages.loop import run_stage

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

# host memory the model costs this rank: the high-water mark of building and sharding it, over what it held before
# (the mark is reset first, so one launch measures both paths)
grown = []
build = distributed.DataParallel.build_sharded

def measured(self, *args, **kwargs):
    gc.collect()
    ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)  # the earlier run's freed pages leave the baseline
    before = status("VmRSS:")
    open("/proc/self/clear_refs", "w").write("5")
    model = build(self, *args, **kwargs)
    grown.append(status("VmHWM:") - before)
    return model

distributed.DataParallel.build_sharded = measured
# the test's model: Qwen3.5-tiny's binding at the snapshot's width, registered in-process like any plugin
tiny = plugin_host.load_plugins().get("models", "qwen3.5-tiny")

class WideTestModel:
    @hookimpl
    def register_models(self, register):
        register(dataclasses.replace(tiny, name="qwen3.5-wide-test", hidden_size=int(sys.argv[6])))

plugin_host._HOST = plugin_host.load_plugins(extra={"wide-test-model": WideTestModel()})
for recipe, run in ((sys.argv[1], sys.argv[3]), (sys.argv[2], sys.argv[4])):
    run_stage(load_recipe(recipe), "alignment", Path(run), progress=False, registry=plugin_host._HOST)
Path(sys.argv[5], f"rank{dist.get_rank()}.json").write_text(json.dumps(dict(zip(("meta", "whole"), grown))))
"""


WIDTH = 768


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "alignment" / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_meta_init_matches_whole_model_losses_with_less_host_memory_on_rank_1(prepared, tmp_path):
    from stitch_qwen.published import write_published_snapshot

    # Qwen3.5 at width 768 with 16 layers: 57 M parameters (227 MB in fp32) in many similar tensors, as a real
    # model is; rank 1 briefly holds one whole tensor while it receives its shard, never the model
    snap = tmp_path / "snap"
    write_published_snapshot("qwen3.5-4b", snap, layers=16, width=WIDTH, dtype=torch.float32)
    model_bytes = sum(f.stat().st_size for f in snap.glob("*.safetensors"))
    recipes, runs = [], []
    for meta in (True, False):
        name = "meta" if meta else "whole"
        recipes.append(write_recipe(tmp_path / f"{name}.yaml", model={"name": "qwen3.5-wide-test", "snapshot": str(snap)},
                                    parallel={"world_size": 2, "meta_init": meta},
                                    stages__alignment__steps=3, stages__alignment__save_every=3))
        runs.append(tmp_path / name)
        copy_prepared(prepared / "run", runs[-1])
    (tmp_path / "launch.py").write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(tmp_path / "launch.py"), *map(str, recipes), *map(str, runs), str(tmp_path), str(WIDTH)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    meta, whole = _losses(runs[0]), _losses(runs[1])
    assert len(meta) == 3 and meta == whole, (meta, whole)  # same weights on every rank, same reductions
    grown = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)}
    # under meta init rank 1 holds its shards and one whole tensor at a time, rank 0 the whole model as before
    assert grown[1]["whole"] - grown[1]["meta"] > model_bytes / 4, (grown, model_bytes)
    assert grown[1]["meta"] < grown[0]["meta"], (grown, model_bytes)
