"""The parallel layout's arithmetic (world size against data/tensor/expert parallel sizes, batch divisibility, GPUs
per role). Types, ranges and cross-stage contracts are the schema's (``stitch.config.recipe``), checked when the
recipe loads; the checks that need the installed plugins are ``stitch.host.validate``'s."""

from __future__ import annotations

from typing import Any

from stitch.config.options import StageOptions
from stitch.config.recipe import Recipe, RecipeError
from stitch.config.schema import ParallelConfig

# -- parallel layout -----------------------------------------------------------------------------------
# What a training stage divides across data-parallel ranks: every rank takes an equal share of it.
DATA_PARALLEL_BATCH = {"alignment": ("batch_size", "packs"), "sft": ("batch_size", "packs")}


def fail(recipe: Recipe, message: str) -> None:
    """Raise a RecipeError naming the recipe."""
    raise RecipeError(f"{recipe.where()}: {message}")


def _divides(recipe: Recipe, what: str, size: int, into: str, total: int) -> None:
    if total % size:
        fail(recipe, f"{what}={size} does not divide {into}={total} ({total} % {size} = {total % size})")


def check_batch_divisible(recipe: Recipe, stage: str, opts: Any, data_parallel: int, label: str) -> None:
    """Refuse a stage whose per-step batch cannot be split evenly over ``data_parallel`` ranks."""
    if stage not in DATA_PARALLEL_BATCH or data_parallel <= 1:
        return
    key, unit = DATA_PARALLEL_BATCH[stage]
    value = getattr(opts, key)
    if value % data_parallel:
        fail(recipe, f"stages.{stage}.{key}={value} {unit} is not divisible by {label}={data_parallel} "
                      f"({value} % {data_parallel} = {value % data_parallel}); every rank takes an equal share "
                      f"of the global batch")


def resolve_parallel(recipe: Recipe) -> tuple[int | None, int | None]:
    """(world_size, data_parallel) the recipe implies; None where the launch decides. Raises on impossible sizes."""
    par = recipe.parallel or ParallelConfig()
    tp, ep = par.tensor_parallel, par.expert_parallel
    world = par.world_size
    if world is None and par.data_parallel is not None:
        world = par.data_parallel * tp
    if world is None:
        return None, None
    _divides(recipe, "parallel.tensor_parallel", tp, "world_size", world)
    _divides(recipe, "parallel.expert_parallel", ep, "world_size", world)
    dp = par.data_parallel if par.data_parallel is not None else world // tp
    if dp * tp != world:
        fail(recipe, f"parallel.data_parallel={dp} x tensor_parallel={tp} = {dp * tp} ranks, but "
                      f"world_size={world}; data_parallel x tensor_parallel must equal world_size")
    return world, dp


def check_parallel(recipe: Recipe, resolved: dict[str, StageOptions]) -> None:
    """The ``parallel`` section's arithmetic, spelled out in every refusal; then what stitch cannot do yet."""
    par = recipe.parallel
    if par is None:
        return
    world, dp = resolve_parallel(recipe)
    if par.roles_given and "grpo" in recipe.stages:
        need = par.policy_gpus + par.rollout_gpus * par.rollout_replicas
        if world is not None and need > world:
            fail(recipe, f"GRPO needs policy {par.policy_gpus} + rollout {par.rollout_gpus} x "
                          f"{par.rollout_replicas} replicas = {need} GPUs, world_size is {world}")
        if "grpo" in resolved and resolved["grpo"].prompts_per_step % par.rollout_replicas:
            prompts, replicas = resolved["grpo"].prompts_per_step, par.rollout_replicas
            fail(recipe, f"stages.grpo.prompts_per_step={prompts} prompts is not divisible by "
                          f"rollout_replicas={replicas} ({prompts} % {replicas} = {prompts % replicas})")
        check_grpo_roles(recipe, par, resolved.get("grpo"))
    for stage, opts in resolved.items():
        check_batch_divisible(recipe, stage, opts, dp or 1, "data_parallel")
    if par.tensor_parallel > 1:
        fail(recipe, f"parallel.tensor_parallel={par.tensor_parallel}: tensor parallelism is not implemented for "
                      f"training in stitch yet (alignment and SFT run FSDP2 data parallel only); set "
                      f"tensor_parallel: 1")
    if par.expert_parallel > 1:
        fail(recipe, f"parallel.expert_parallel={par.expert_parallel}: expert parallelism is not implemented in "
                      f"stitch yet (FSDP2 shards every expert tensor across the data-parallel ranks instead; "
                      f"see docs/scaling.md); set expert_parallel: 1")


def check_grpo_roles(recipe: Recipe, par: ParallelConfig, grpo: Any) -> None:
    """What the Ray placement of GRPO's roles can do today: one policy process on one GPU, replicas of one GPU
    each, and only when the stage places its rollouts on Ray at all."""
    if par.policy_gpus != 1:
        fail(recipe, f"parallel.gpus.policy={par.policy_gpus}: expected 1 (the GRPO policy trains in the "
                      f"`stitch train grpo` process on one GPU; sharding it over several GPUs is not implemented), "
                      f"got {par.policy_gpus}")
    if par.rollout_gpus != 1:
        fail(recipe, f"parallel.gpus.rollout={par.rollout_gpus}: expected 1 GPU per rollout replica (a replica "
                      f"spanning several GPUs, a tensor-parallel engine, is not implemented), got "
                      f"{par.rollout_gpus}; raise parallel.rollout_replicas instead")
    if grpo is not None and par.rollout_replicas > 1 and grpo.placement != "ray":
        fail(recipe, f"parallel.rollout_replicas={par.rollout_replicas} needs Ray-placed rollouts: expected "
                      f"stages.grpo.placement: ray, got {grpo.placement!r} (a colocated engine is one replica in "
                      f"this process, the others would be ignored)")


def check_launch(recipe: Recipe, stage: str, opts: Any, world_size: int) -> None:
    """At launch: torchrun's WORLD_SIZE must be the recipe's ``parallel.world_size`` (when given), and the
    stage's batch must split evenly over it."""
    world, _ = resolve_parallel(recipe)
    if world is not None and world != world_size:
        fail(recipe, f"parallel.world_size={world}, but this launch has WORLD_SIZE={world_size}; start it with "
                      f"`torchrun --nproc-per-node {world} -m stitch train {stage} ...`"
                      + (" (or `stitch train` alone for one process)" if world == 1 else ""))
    check_batch_divisible(recipe, stage, opts, world_size, "WORLD_SIZE")
