"""The shipped multi-GPU recipes: their layout adds up at load (GPUs per GRPO role against the world size, prompts
over replicas, batches over data-parallel ranks), their header's launch commands match it, and a variant the
machine cannot run is refused naming the field, what was expected and what was found. And the refit payload a
rollout replica receives over a gloo broadcast is, bitwise, the policy's merged weights."""

from __future__ import annotations

import re

import pytest

from stitch.config.recipe import RecipeError, load_recipe
from stitch.config.validate import check_launch
from stitch.host.host import get_host, load_plugins
from stitch.host.validate import validate_recipe
from tests.stitch_testing import write_recipe

MULTI_GPU = {"qwen3.5-4b-grpo-2gpu": (2, 1), "qwen3.5-4b-grpo-8gpu": (8, 7)}  # name -> (GPUs, rollout replicas)


def _refusal(name: str, *overrides: str) -> str:
    recipe = load_recipe(name, get_host(), overrides=overrides)
    with pytest.raises(RecipeError) as err:
        validate_recipe(recipe, get_host())
    return str(err.value)


def test_the_multi_gpu_recipes_are_shipped():
    shipped = set(load_plugins().names("recipes"))
    assert set(MULTI_GPU) <= shipped
    # every shipped recipe with a parallel section is listed here, so its layout is checked below
    assert {n for n in shipped if load_recipe(n, get_host()).parallel is not None} == set(MULTI_GPU)


@pytest.mark.parametrize("name", sorted(MULTI_GPU))
def test_multi_gpu_grpo_recipe_places_the_policy_and_its_replicas_on_exactly_its_gpus(name):
    gpus, replicas = MULTI_GPU[name]
    recipe = load_recipe(name, get_host())
    validate_recipe(recipe, get_host())
    par, grpo = recipe.parallel, recipe.stages["grpo"]
    assert (par.world_size, par.rollout_replicas, grpo.placement) == (gpus, replicas, "ray")
    assert par.policy_gpus + par.rollout_gpus * par.rollout_replicas == par.world_size  # no GPU left idle
    assert grpo.prompts_per_step % replicas == 0
    for stage in ("alignment", "sft"):  # FSDP2 over every GPU: the launch check passes at the recipe's world
        check_launch(recipe, stage, recipe.stages[stage], gpus)


@pytest.mark.parametrize("name", sorted(MULTI_GPU))
def test_multi_gpu_recipe_header_launches_data_parallel_stages_on_its_world_and_grpo_in_one_process(name):
    gpus, _ = MULTI_GPU[name]
    recipe = load_recipe(name, get_host())
    launch = re.compile(r"^#   ((?:torchrun .* -m )?stitch (?:train (\w+)|prepare) .*)$")
    found = [m for line in recipe.path.read_text().splitlines() if (m := launch.match(line))]
    commands = [m.group(1) for m in found]
    by_stage = {m.group(2) or "prepare": m.group(1) for m in found}
    assert set(by_stage) == {"prepare", "alignment", "sft", "grpo"}
    for stage in ("alignment", "sft"):
        assert f"torchrun --standalone --nproc-per-node {gpus} -m stitch train {stage}" in by_stage[stage]
    for stage in ("prepare", "grpo"):  # one process: GRPO places its replicas through Ray itself
        assert by_stage[stage].startswith("stitch ") and "torchrun" not in by_stage[stage]
    assert all(f"--recipe {name} " in c for c in commands)


def test_sft_of_a_multi_gpu_recipe_started_without_torchrun_is_refused_with_the_command():
    recipe = load_recipe("qwen3.5-4b-grpo-8gpu", get_host())
    with pytest.raises(RecipeError, match=r"parallel\.world_size=8, but this launch has WORLD_SIZE=1; start it "
                                          r"with `torchrun --nproc-per-node 8 -m stitch train sft"):
        check_launch(recipe, "sft", recipe.stages["sft"], 1)


@pytest.mark.parametrize(
    ("name", "overrides", "message"),
    [
        ("qwen3.5-4b-grpo-2gpu", ["parallel.rollout_replicas=2"],
         "GRPO needs policy 1 + rollout 1 x 2 replicas = 3 GPUs, world_size is 2"),
        ("qwen3.5-4b-grpo-8gpu", ["parallel.rollout_replicas=8", "stages.grpo.prompts_per_step=16"],
         "GRPO needs policy 1 + rollout 1 x 8 replicas = 9 GPUs, world_size is 8"),
        ("qwen3.5-4b-grpo-8gpu", ["stages.grpo.prompts_per_step=8"],
         "stages.grpo.prompts_per_step=8 prompts is not divisible by rollout_replicas=7 (8 % 7 = 1)"),
        ("qwen3.5-4b-grpo-8gpu", ["stages.sft.batch_size=12"],
         "stages.sft.batch_size=12 packs is not divisible by data_parallel=8 (12 % 8 = 4)"),
        ("qwen3.5-4b-grpo-8gpu", ["parallel.gpus.policy=2", "parallel.rollout_replicas=6",
                                  "stages.grpo.prompts_per_step=12"],
         "parallel.gpus.policy=2: expected 1 (the GRPO policy trains in the `stitch train grpo` process on one "
         "GPU; sharding it over several GPUs is not implemented), got 2"),
        ("qwen3.5-4b-grpo-8gpu", ["parallel.gpus.rollout=2", "parallel.rollout_replicas=3",
                                  "stages.grpo.prompts_per_step=12"],
         "parallel.gpus.rollout=2: expected 1 GPU per rollout replica (a replica spanning several GPUs, a "
         "tensor-parallel engine, is not implemented), got 2"),
        ("qwen3.5-4b-grpo-8gpu", ["stages.grpo.placement=colocated"],
         "parallel.rollout_replicas=7 needs Ray-placed rollouts: expected stages.grpo.placement: ray, got "
         "'colocated'"),
        ("qwen3.5-4b-grpo-8gpu", ["parallel.expert_parallel=8"],
         "parallel.expert_parallel=8: expert parallelism is not implemented in stitch yet"),
    ],
    ids=["2gpu-with-2-replicas", "8gpu-with-8-replicas", "8gpu-prompts-over-7-replicas", "8gpu-sft-batch",
         "policy-on-2-gpus", "replica-on-2-gpus", "replicas-without-ray", "expert-parallel"],
)
def test_multi_gpu_recipe_variant_the_layout_cannot_run_is_refused_at_load_naming_the_field(name, overrides,
                                                                                            message):
    assert message in _refusal(name, *overrides)


def test_placed_roles_with_one_replica_may_stay_colocated(tmp_path):
    # the colocated engine is one replica: GPU roles with rollout_replicas=1 ask for nothing Ray must do
    parallel = {"world_size": 2, "gpus": {"policy": 1, "rollout": 1}, "rollout_replicas": 1}
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", parallel=parallel))
    assert recipe.parallel.roles_given and recipe.stages["grpo"].placement == "colocated"
    validate_recipe(recipe, get_host())


# -- the refit payload, end to end on gloo (no Ray: the worker is constructed directly) -------------------------


def test_rollout_worker_holds_exactly_the_policys_merged_weights_after_each_broadcast_refit():
    import datetime
    import threading

    import torch
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model

    from stitch.host.host import get_host
    from stitch.model.loading import load_model
    from stitch.rollout.ray_rollout import (
        RolloutWorker,
        broadcast_state_dict,
        dominant_dtype,
        manifest_of,
        new_group,
        validate_payload,
        worker_specs,
    )
    from stitch.rollout.vllm_engine import merged_state_dict

    spec = get_host().get("models", "qwen3.5-tiny")  # random-init, built in seconds
    policy = get_peft_model(load_model(spec, registry=get_host()), LoraConfig(r=4, lora_alpha=8, bias="none",
                                                         target_modules=list(spec.lora_target_modules)))
    worker = RolloutWorker(1, engine="embedded", model=spec.name, specs=worker_specs(get_host(), "embedded", spec.name),
                           dtype="float32", pad_id=0, eos_id=None, suppress_ids=[], engine_config=None, vocab_size=None, env={}, seed=0)
    base = {k: v.clone() for k, v in worker.lm.state_dict().items()}
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timeout, wait_for_workers=False)

    def on_worker(fn, *args):  # the worker's half of a collective, beside the policy's half in this thread
        thread = threading.Thread(target=fn, args=args)
        thread.start()
        return thread

    joining = on_worker(worker.join, "127.0.0.1", store.port, 2, "gloo", 60.0)
    group = new_group(store, 0, 2, "gloo", timeout)
    joining.join(timeout=60)
    gen = torch.Generator().manual_seed(0)
    try:
        for update in range(2):  # the first broadcast builds the worker's engine, the second refits it
            with torch.no_grad():  # an update of the trained weights: the merge is no longer the base
                for name, p in policy.named_parameters():
                    if "lora_B" in name:
                        p.add_(0.1 * torch.randn(p.shape, generator=gen))
            merged = merged_state_dict(policy)
            payload = validate_payload(worker.expected, dominant_dtype(policy), merged)  # what refit() sends
            manifest = manifest_of(payload)
            receiving = on_worker(worker.receive, manifest, 64 << 10)  # small buckets: many broadcasts
            broadcast_state_dict(group, payload, manifest, torch.device("cpu"), 64 << 10)
            receiving.join(timeout=60)
            held = worker.lm.state_dict()
            assert held.keys() == merged.keys()
            assert all(torch.equal(held[k], merged[k]) for k in merged), f"update {update}"
            changed = [k for k in merged if not torch.equal(merged[k], base[k])]
            assert changed and all(k.rsplit(".", 2)[-2] in spec.lora_target_modules for k in changed), changed
            assert worker.engine is not None and worker.engine.name == "embedded"
    finally:
        worker.close()
        group_close = getattr(group, "shutdown", None) or getattr(group, "abort", None)
        if group_close is not None:
            group_close()
