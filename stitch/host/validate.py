"""The recipe checks that need the installed plugins: registered model, encoder, projector, sentinels and task,
and a pack that holds at least one media block; then the parallel layout's arithmetic (``stitch.config.validate``)."""

from __future__ import annotations

from stitch.config.options import StageOptions
from stitch.config.recipe import Recipe, RecipeError
from stitch.config.validate import check_parallel, fail
from stitch.plugins.registry import Registry
from stitch.plugins.specs import SentinelLayoutError
from stitch.tasks import TaskError, check_task

PACKED_STAGES = ("alignment", "sft")  # stages whose options carry a token_budget


def validate_recipe(recipe: Recipe, host: Registry) -> dict[str, StageOptions]:
    """The recipe's stages (name -> typed options) once everything it names is registered in ``host`` and its
    layout adds up; raises naming the field at fault."""
    model = host.get("models", recipe.model)
    encoder = host.get("encoders", recipe.encoder)
    host.get("projectors", recipe.projector)
    try:  # the family brackets this encoder's modality (a video encoder needs video sentinels)
        host.get("token_sentinels", model.sentinels).for_modality(encoder.modality)
    except SentinelLayoutError as exc:
        fail(recipe, f"field 'encoder': {recipe.encoder!r} is a {encoder.modality} encoder, but model "
                      f"{recipe.model!r}: {exc}")
    try:  # the task's reward/grader import and its DPO pair source, before any data or weights
        check_task(recipe, host)
    except TaskError as exc:
        raise RecipeError(str(exc)) from exc
    # a sample holds at least one media block: start + placeholders + end
    floor = encoder.tokens_per_item + 2
    for stage in PACKED_STAGES:
        opts = recipe.stages.get(stage)
        if opts is not None and opts.token_budget < floor:
            fail(recipe, f"field 'stages.{stage}.token_budget': expected at least {floor} "
                          f"({encoder.tokens_per_item} soft tokens + 2 sentinels), got {opts.token_budget}")
    grpo = recipe.stages.get("grpo")
    if grpo is not None:
        check_engine(recipe, host, grpo.engine, grpo.placement)
    check_parallel(recipe, recipe.stages)
    return dict(recipe.stages)


def check_engine(recipe: Recipe, host: Registry, name: str, placement: str) -> None:
    """GRPO's rollout engine is registered here and takes the weights its placement sends."""
    spec = host.get("rollout_engines", name)  # a miss names the plugin to install, as for the model
    if placement == "ray" and not spec.merged_refit:
        ray_engines = [e for e in host.names("rollout_engines") if host.get("rollout_engines", e).merged_refit]
        fail(recipe, f"field 'stages.grpo.engine': expected an engine that takes merged weights under placement: "
                     f"ray ({', '.join(ray_engines)}), got {name!r} (its refit takes only the adapter)")
