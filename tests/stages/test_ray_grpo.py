"""GRPO with Ray-placed rollout workers on a local Ray cluster (CPU, gloo): the workers' engines hold the
policy's merged weights, refit by a collective broadcast."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from stitch.config.recipe import load_recipe
from stitch.host.host import get_host
from stitch.rollout.ray_rollout import (
    broadcast_state_dict,
    manifest_of,
    new_group,
    plan_buckets,
    receive_state_dict,
)
from stitch.stages.loop import run_stage
from tests.stitch_testing import write_recipe

RAY_MISSING = "ray is not installed (a test dependency: ray==2.60.0); the Ray-placed GRPO tests need a local cluster"


@pytest.fixture(scope="module")
def ray_cluster(stitch_cache):
    ray = pytest.importorskip("ray", reason=RAY_MISSING)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def _donor(run: Path) -> Path:
    return run / "sft" / "checkpoints" / (run / "sft" / "checkpoints" / "LATEST").read_text().strip()


def _placement_groups_left(wait_s: float = 10.0) -> list[str]:
    """States of placement groups not yet removed (removal is asynchronous: polled for up to ``wait_s``)."""
    import ray

    deadline = time.monotonic() + wait_s
    while True:
        left = [pg["state"] for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def test_refit_broadcast_carries_mixed_dtypes_exactly_across_several_buckets():
    import datetime
    import threading

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=30)
    state = {"w": torch.randn(30, 7), "ids": torch.arange(9), "half": torch.randn(5, dtype=torch.bfloat16),
             "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3), "flag": torch.tensor([True, False])}
    manifest = manifest_of(state)
    assert len(plan_buckets(manifest, 128)) > 2
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timeout, wait_for_workers=False)
    got = {}

    def receiver():
        client = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=timeout)
        got.update(receive_state_dict(new_group(client, 1, 2, "gloo", timeout), manifest, torch.device("cpu"), 128))

    thread = threading.Thread(target=receiver)
    thread.start()
    broadcast_state_dict(new_group(store, 0, 2, "gloo", timeout), state, manifest, torch.device("cpu"), 128)
    thread.join(timeout=30)
    assert list(got) == list(state)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in state.items())


def test_ray_worker_greedy_tokens_equal_the_colocated_engine_on_merged_weights_before_and_after_a_broadcast_refit(
        sft_run, ray_cluster):
    from stitch.model.loading import load_model
    from stitch.rollout.engines import EmbeddedEngine
    from stitch.rollout.ray_rollout import RayRolloutEngine
    from stitch.rollout.vllm_engine import RefitError, merged_state_dict
    from stitch.stages.session import StitchSession

    session = StitchSession.open(load_recipe(write_recipe(sft_run.parent / "ray.yaml")), sft_run, registry=get_host())
    model = session.binding.build_model(adapter_from=_donor(sft_run) / "adapter",
                                projector_from=_donor(sft_run) / "projector")
    sentinels = list(session.sentinel_ids.as_dict().values())
    eos = session.tokenizer.eos_token_id
    rows = list(session.data.rows("grpo"))[:3]
    with torch.no_grad():
        prompts = [model.embed(torch.tensor([session.prompt_ids(r.question, r.num_items)]), session.data.features(r),
                           [r.id])[0] for r in rows]

    def colocated():  # the embedded engine in this process, on a plain LM holding the merged weights
        plain = load_model(session.model_spec, registry=get_host())
        plain.load_state_dict(merged_state_dict(model.lm))
        engine = EmbeddedEngine(plain, pad_id=session.pad_id, eos_id=eos, suppress_ids=sentinels)
        return engine.generate(prompts, 1, 8, greedy=True)

    def tokens(completions):
        return [c.token_ids for c in completions]

    engine = RayRolloutEngine(model.lm, engine="embedded", model=session.model_spec.name, pad_id=session.pad_id,
                              eos_id=eos, suppress_ids=sentinels, replicas=1, bucket_bytes=256 << 10, registry=get_host())
    try:
        assert engine.backend == "gloo" and len(engine.workers) == 1
        assert len(plan_buckets(manifest_of(merged_state_dict(model.lm)), 256 << 10)) > 1  # several broadcasts
        before_local, before_remote = colocated(), engine.generate(prompts, 1, 8, greedy=True)
        assert [c.prompt_index for c in before_remote] == [0, 1, 2]
        assert tokens(before_remote) == tokens(before_local)
        parity = max(abs(a - b) for r, c in zip(before_remote, before_local, strict=True)
                     for a, b in zip(r.logprobs, c.logprobs, strict=True))
        assert parity < 1e-4

        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():  # a real update of the trained weights (the adapter's B matrices)
            for name, p in model.lm.named_parameters():
                if "lora_B" in name:
                    p.add_(0.5 * torch.randn(p.shape, generator=gen))
        after_local = colocated()
        assert tokens(after_local) != tokens(before_local)  # the update changes greedy decoding
        assert tokens(engine.generate(prompts, 1, 8, greedy=True)) == tokens(before_local)  # its own weights
        engine.refit(None)  # merge + broadcast
        assert tokens(engine.generate(prompts, 1, 8, greedy=True)) == tokens(after_local)

        with pytest.raises(RefitError, match="missing"):  # refused before any worker joins a broadcast
            engine.refit({"model.embed_tokens.weight": merged_state_dict(model.lm)["model.embed_tokens.weight"]})
        assert tokens(engine.generate(prompts, 1, 8, greedy=True)) == tokens(after_local)
    finally:
        engine.close()
    assert not engine.workers and engine.group is None and _placement_groups_left() == []


def test_grpo_with_ray_placed_rollouts_keeps_parity_and_writes_checkpoints_and_metrics_like_colocated(
        sft_run, tmp_path, ray_cluster):
    runs = {}
    for placement in ("colocated", "ray"):
        run = tmp_path / placement / "run"
        shutil.copytree(sft_run, run)
        recipe = load_recipe(write_recipe(tmp_path / f"{placement}.yaml", stages__grpo__steps=3,
                                          stages__grpo__placement=placement, parallel={"rollout_replicas": 1}))
        runs[placement] = (run, run_stage(recipe, "grpo", run, progress=False, registry=get_host()))
    (run, summary), (local_run, local) = runs["ray"], runs["colocated"]
    assert summary["placement"] == "ray" and local["placement"] == "colocated"
    assert summary["steps"] == local["steps"] == 3
    assert summary["parity_max_abs_logprob"] < 1e-3  # worker engine on merged weights == the training forward
    history = [json.loads(line) for line in (run / "grpo" / "metrics.jsonl").read_text().splitlines()]
    local_history = [json.loads(line) for line in (local_run / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in history] == [1, 2, 3]
    assert [set(r) for r in history] == [set(r) for r in local_history]

    def layout(root: Path) -> list[str]:
        return sorted(str(p.relative_to(root)) for p in (root / "grpo" / "checkpoints").rglob("*"))

    assert layout(run) == layout(local_run)
    assert (run / "grpo" / "checkpoints" / "LATEST").read_text().strip() == Path(summary["checkpoint"]).name
    assert _placement_groups_left() == []  # workers and their placement group are gone after the run


def test_grpo_with_ray_placed_rollouts_closes_its_workers_when_a_step_fails(sft_run, tmp_path, ray_cluster,
                                                                          monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(sft_run, run)
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", stages__grpo__placement="ray"))

    def boom(*args, **kwargs):
        raise RuntimeError("reward model exploded")

    monkeypatch.setattr("stitch.stages.grpo.group_advantages", boom)
    with pytest.raises(RuntimeError, match="exploded"):
        run_stage(recipe, "grpo", run, progress=False, registry=get_host())
    assert _placement_groups_left() == []
