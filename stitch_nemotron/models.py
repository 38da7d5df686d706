"""Nemotron-H base-LM bindings: sources, hidden widths, LoRA target sets, the embeddings-capable loader."""

from __future__ import annotations

import logging
from typing import Any

import torch

from stitch.accel import varlen_kernels_ready, warn_kernel_fallback
from stitch.api import ModelSource, ModelSpec, automodel_backend
from stitch_nemotron.kernels import use_varlen
from stitch_nemotron.published import snapshot_writer
from stitch_nemotron.sentinels import SENTINELS
from stitch_nemotron.tiny import TINY_HIDDEN, build_lightning_tiny, build_nano_tiny

# Families that get LoRA; each survives the GRPO handoff (merge into the base weight, refit as a plain Linear).
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MAMBA_INPUT = ("in_proj",)
SHARED_EXPERT = ("shared_experts.up_proj", "shared_experts.down_proj")

COMMON_EXCLUSIONS: dict[str, str] = {
    "mixer.out_proj (Mamba-2)": "peft refuses it for model_type nemotron_h (ValueError): the fused Mamba-2 kernel "
    "(mamba_split_conv1d_scan_combined) reads out_proj.weight directly, so a LoRA there would be bypassed in "
    "training. The same refusal makes target_modules='all-linear' fail on Nemotron-H",
    "mixer.conv1d (Mamba-2)": "refused by peft for the same reason (read directly by the fused kernels); it is a "
    "depthwise convolution with no low-rank structure anyway",
    "embeddings, lm_head": "vocabulary-sized; soft tokens enter through the projector, and an adapter here would "
    "change every text token the rollout engine embeds",
}
NANO_EXCLUSIONS: dict[str, str] = {
    **COMMON_EXCLUSIONS,
    "mlp blocks (mixer.up_proj, mixer.down_proj)": "left out by choice, matching the reference recipe's qualified "
    "set (attention + Mamba input projections); they survive merge/refit like any Linear, so append "
    "'up_proj', 'down_proj' to lora_target_modules to opt in",
}
LIGHTNING_EXCLUSIONS: dict[str, str] = {
    **COMMON_EXCLUSIONS,
    "mixer.experts (routed: up_proj, down_proj)": "fused 3-D parameters [experts, out, in], reachable only via "
    "peft target_parameters; a merge rewrites every routed expert's full tensor (most of the model's weights), "
    "so each GRPO refit would ship nearly the whole model instead of a few layers. The shared expert carries "
    "the adaptation instead",
    "mixer.gate (router, e_score_correction_bias)": "routing logits: a small change flips top-k choices, breaking "
    "train/rollout routing parity and expert load mid-RL; it is a bare Parameter, not an nn.Linear",
}

log = logging.getLogger("stitch")

# What stitch-nemotron[kernels] installs, import name -> distribution: fla's simple-GLA scan and causal conv for the
# Mamba-2 mixers (stitch_nemotron/kernels.py; Triton >= 3.7.1 on Hopper)
KERNELS_EXTRA = "stitch-nemotron[kernels]"
KERNELS = {"fla": "flash-linear-attention"}

PACKING_NOTE = (
    "Packed only on a CUDA device with flash-linear-attention installed: stitch then runs the Mamba-2 mixers on "
    "fla's varlen kernels fed the sample starts (stitch_nemotron/kernels.py). Otherwise unpacked: NemotronH "
    "derives no sample boundaries from position_ids and has no seq_idx / cu_seqlens argument (one smuggled "
    "through **kwargs reaches only the mamba_ssm / causal-conv1d kernels; the PyTorch scan and conv drop it), so "
    "the Mamba-2 SSM state and its conv window run from one packed sample into the next. Only the attention "
    "blocks would honor reset position_ids (with use_cache=False and no attention_mask)."
)


def load_nemotron_h(spec: ModelSpec, source: ModelSource, dtype: torch.dtype, trust_remote_code: bool) -> Any:
    """stitch's NemotronHForCausalLM (``generate(inputs_embeds=...)`` works) from safetensors via from_pretrained;
    a checkpoint key that does not land (published ``backbone.*`` names are renamed by transformers) is refused."""
    from stitch_nemotron.generation import NemotronHForCausalLM  # deferred: plugin loading skips transformers

    model, info = NemotronHForCausalLM.from_pretrained(
        **source.pretrained_kwargs(), dtype=dtype, use_safetensors=True, trust_remote_code=trust_remote_code,
        output_loading_info=True,
    )
    problems = {k: sorted(v) for k, v in info.items() if v}
    if problems:  # a missing key would train on random init, an unexpected one is a weight silently dropped
        raise ValueError(f"loading NemotronHForCausalLM for model {spec.name!r} from {source.describe()} left "
                         f"problems: {problems}")
    return model


def install_sample_starts(model: Any) -> bool:
    """On a GPU with fla, run a freshly loaded Nemotron-H's Mamba-2 mixers on the varlen kernels; True when done.

    Called by the core's ``load_model`` (``ModelSpec.install_sample_starts``). On a GPU without the kernels extra
    (or with a Triton fla refuses) it warns once per process, naming what to install.
    """
    warn_kernel_fallback(KERNELS_EXTRA, KERNELS)
    if not varlen_kernels_ready():
        return False
    swapped = use_varlen(model)
    log.info("%s: %d Mamba-2 mixers run on flash-linear-attention kernels, packed with sample boundaries",
             type(model).__name__, swapped)
    return True


AUTOMODEL_INSTALL = ('pip install "stitch-nemotron[automodel]" (or, without its heavy dependencies: '
                     'pip install --no-deps nemo-automodel==0.7.0), and mamba-ssm: AutoModel\'s Mamba-2 mixer '
                     'calls its Triton kernels with no PyTorch fallback')
AUTOMODEL = "nemo_automodel.components.models.nemotron_v3.model:NemotronHForCausalLM"


def nemotron_spec(name: str, source: ModelSource, hidden_size: int, moe: bool, description: str,
                  published: bool = False) -> ModelSpec:
    return ModelSpec(
        name=name,
        architecture="NemotronHForCausalLM",
        sentinels=SENTINELS.name,
        source=source,
        hidden_size=hidden_size,
        lora_target_modules=ATTENTION + MAMBA_INPUT + (SHARED_EXPERT if moe else ()),
        lora_exclusions=LIGHTNING_EXCLUSIONS if moe else NANO_EXCLUSIONS,
        load=load_nemotron_h,
        supports_packing=False,
        packing_when=varlen_kernels_ready,
        install_sample_starts=install_sample_starts,
        kernels=KERNELS,
        # a packed Nemotron-Nano-4B step is ~5 % slower with its LoRA layers as CUDA graphs (and with the Mamba-2
        # mixers' elementwise sides graphed too): it is paced by the device, so the copies in and out of each graph
        # cost more than the launches saved
        cuda_graphs=False,
        packing_note=PACKING_NOTE,
        snapshot=snapshot_writer(name) if published else None,
        # AutoModel's NemotronV3 keeps transformers' module names for every LoRA target (its adapter reads the
        # published backbone.* and transformers' model.* keys alike)
        backends={"automodel": automodel_backend(AUTOMODEL, ATTENTION + MAMBA_INPUT + (SHARED_EXPERT if moe else ()),
                                                 AUTOMODEL_INSTALL, kernels=("mamba_ssm",))},
        description=description,
    )


MODELS: tuple[ModelSpec, ...] = (
    nemotron_spec(
        "nemotron-3-nano-4b",
        ModelSource(
            repo_id="nvidia/NVIDIA-Nemotron-3-Nano-4B-BF16",
            revision="dfaf35de3e30f1867dd8dbc38a7fc9fb52d3914f",
        ),
        # published: 42 blocks (21 Mamba-2, 4 attention, 17 MLP), sources in docs/models.md; load_model still
        # refuses a checkpoint whose width differs
        3136,
        moe=False,
        description="Nemotron-3-Nano-4B: hybrid Mamba-2 / attention / MLP, text only.",
        published=True,
    ),
    nemotron_spec(
        "nemotron-3.5-lightning-30b-a3b",
        ModelSource(
            repo_id="nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-BF16",
            revision="b3caaabed0263651a17dc1f2d4ce97e794f76c44",
        ),
        # 2688 in two public ports of the checkpoint (no config.json found), docs/models.md; load_model refuses
        # the checkpoint if its config says otherwise
        2688,
        moe=True,
        description="Nemotron-3.5-Lightning-30B-A3B: hybrid Mamba-2 / attention / MoE (routed + shared expert).",
        published=True,
    ),
    nemotron_spec(
        "nemotron-nano-tiny",
        ModelSource(builder=build_nano_tiny, builder_key="nemotron-nano-tiny-v3"),
        TINY_HIDDEN,
        moe=False,
        description="Tiny random-init Nemotron-H (Mamba-2, MLP, attention, MLP) for tests.",
    ),
    nemotron_spec(
        "nemotron-lightning-tiny",
        ModelSource(builder=build_lightning_tiny, builder_key="nemotron-lightning-tiny-v3"),
        TINY_HIDDEN,
        moe=True,
        description="Tiny random-init Nemotron-H MoE (Mamba-2, MoE, attention, MoE; 4 experts + shared) for tests.",
    ),
)
