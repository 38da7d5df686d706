"""Qwen3.5 / Qwen3.6 base-LM bindings: sources, hidden widths, LoRA target sets, the VLM adapter they name, and
the sample-start path they install for packed training."""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from stitch.accel import fla_triton_problem, varlen_kernels_ready, warn_kernel_fallback
from stitch.api import ModelSource, ModelSpec, automodel_backend
from stitch_qwen.kernels import (
    install_fused_kernels,
    keep_reference_rule,
    keep_rules_off_gpu_on_torch,
    use_fused_kernels,
    use_varlen,
)
from stitch_qwen.published import snapshot_writer
from stitch_qwen.sentinels import SENTINELS
from stitch_qwen.tiny import (
    TINY_HIDDEN,
    build_qwen35_demo,
    build_qwen35_moe_tiny,
    build_qwen35_tiny,
    write_tokenizer,
)
from stitch_qwen.vlm_layout import VLM_TO_TEXT

# Families that get LoRA; each survives the GRPO handoff (merge into the base weight, refit as a plain Linear).
FULL_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
LINEAR_ATTENTION = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")  # Gated DeltaNet
SHARED_EXPERT = ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj")

COMMON_EXCLUSIONS: dict[str, str] = {
    "linear_attn.conv1d": "depthwise causal convolution (kernel 4, one filter per channel): no low-rank structure "
    "to adapt, and the fused causal-conv kernels read its weight directly",
    "embed_tokens, lm_head": "vocabulary-sized and tied on the small models; soft tokens enter through the "
    "projector, and an adapter here would change every text token the rollout engine embeds",
}
DENSE_EXCLUSIONS: dict[str, str] = {
    **COMMON_EXCLUSIONS,
    "mlp.gate_proj, mlp.up_proj, mlp.down_proj": "dense MLP left out by choice, matching the reference recipe's "
    "qualified set (attention + token-mixer projections); it would survive merge/refit like any Linear, so "
    "append the names to lora_target_modules to opt in (adapter size roughly doubles)",
}
MOE_EXCLUSIONS: dict[str, str] = {
    **COMMON_EXCLUSIONS,
    "mlp.experts (routed: gate_up_proj, down_proj)": "fused 3-D parameters [experts, out, in], reachable only via "
    "peft target_parameters; a merge rewrites every routed expert's full tensor (most of the model's weights), "
    "so each GRPO refit would ship nearly the whole model instead of a few layers. The shared expert carries "
    "the adaptation instead",
    "mlp.gate (router)": "routing logits: a small change flips top-k choices, breaking train/rollout routing "
    "parity and expert load mid-RL; it is a bare Parameter (TopKRouter), not an nn.Linear",
    "mlp.shared_expert_gate": "a 1-wide sigmoid gate (hidden -> 1) mixing the shared expert in; rank-r LoRA onto "
    "one output is degenerate and, like the router, it is a gate",
}

log = logging.getLogger("stitch")

PACKING_NOTE = (
    "Packed only on a CUDA device with flash-linear-attention installed: stitch then flattens packed rows into one "
    "row carrying the sample starts, which fla's varlen Gated DeltaNet rule and stitch's varlen causal conv honour "
    "(stitch_qwen/kernels.py). Otherwise unpacked: the linear-attention layers (Gated DeltaNet) carry a recurrent "
    "state and a 4-tap causal-conv window along the row, and transformers' PyTorch path ignores position-id resets "
    "and cu_seqlens, so one packed sample's state would leak into the next. The full-attention layers alone would "
    "be fine (with use_cache=False and no attention_mask, transformers derives a block-causal mask from reset "
    "position_ids)."
)
HOW_TO_LOAD_VLM = (
    "Text layout loads with from_pretrained; stitch maps the native VLM layout through the state-dict adapter "
    "'qwen3.5-vlm-to-text' (vision tower dropped explicitly, never read)."
)


def install_sample_starts(model: Any) -> bool:
    """On a GPU with fla, make a freshly loaded Qwen3.5 hybrid pack with sample boundaries; True when it did.

    Called by the core's ``load_model`` (``ModelSpec.install_sample_starts``). On a GPU without the kernels extra
    (or with a Triton fla refuses) it warns once per process, naming what to install.
    """
    warn_kernel_fallback(KERNELS_EXTRA, KERNELS)
    keep_rules_off_gpu_on_torch()
    if fla_triton_problem() is not None:  # transformers would take fla's rule, whose backward refuses this Triton
        keep_reference_rule()
    use_fused_kernels(model)  # liger's RMSNorm / SwiGLU on GPU tensors where installed (stitch_qwen/kernels.py)
    if not varlen_kernels_ready():
        return False
    try:
        use_varlen(model)
    except RuntimeError as exc:  # this transformers renamed what the layer calls: training stays unpacked
        log.warning("%s: %s; training unpacked", type(model).__name__, exc)
        return False
    log.info("%s: Gated DeltaNet layers run on flash-linear-attention, packed with sample boundaries",
             type(model).__name__)
    return True


AUTOMODEL_INSTALL = 'pip install "stitch-qwen[automodel]" (or, without its heavy dependencies: pip install --no-deps nemo-automodel==0.7.0)'
_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts(layer: dict[str, Any]) -> dict[str, Any]:
    """One layer's per-expert tensors (the published layout) as transformers' fused ``experts.gate_up_proj``
    [experts, 2 * inter, hidden] (gate rows first) and ``experts.down_proj`` [experts, hidden, inter], the layout
    AutoModel's Qwen3.5-MoE adapter reads in bf16 (it takes per-expert keys only as block-FP8 with scales)."""
    experts: dict[str, dict[int, dict[str, Any]]] = {}
    out = {}
    for key, value in layer.items():
        found = _EXPERT.match(key)
        if found:
            experts.setdefault(found.group(1), {}).setdefault(int(found.group(2)), {})[found.group(3)] = value
        else:
            out[key] = value
    for prefix, by_id in experts.items():
        ids = sorted(by_id)
        if ids != list(range(len(ids))) or any(len(by_id[i]) != 3 for i in ids):
            raise ValueError(f"{prefix}: experts {ids} are not numbered 0..n-1 each with gate/up/down_proj")
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([by_id[i]["gate_proj"], by_id[i]["up_proj"]])
                                                     for i in ids])
        out[f"{prefix}.down_proj"] = torch.stack([by_id[i]["down_proj"] for i in ids])
    return out


AUTOMODEL_DENSE = automodel_backend(
    "nemo_automodel.components.models.qwen3_5.model:Qwen3_5ForCausalLM", FULL_ATTENTION + LINEAR_ATTENTION,
    AUTOMODEL_INSTALL)
AUTOMODEL_MOE = automodel_backend(
    "nemo_automodel.components.models.qwen3_5_moe.model:Qwen3_5MoeForCausalLM",
    # AutoModel names the shared expert in the plural
    FULL_ATTENTION + LINEAR_ATTENTION + tuple(t.replace("shared_expert.", "shared_experts.") for t in SHARED_EXPERT),
    AUTOMODEL_INSTALL, prepare=fuse_experts)


def qwen_dense_spec(name: str, source: ModelSource, hidden_size: int, description: str,
                    published: bool = False) -> ModelSpec:
    return ModelSpec(
        name=name,
        architecture="Qwen3_5ForCausalLM",
        sentinels=SENTINELS.name,
        source=source,
        hidden_size=hidden_size,
        lora_target_modules=FULL_ATTENTION + LINEAR_ATTENTION,
        lora_exclusions=DENSE_EXCLUSIONS,
        state_dict_adapter=VLM_TO_TEXT.name,
        supports_packing=False,
        packing_when=varlen_kernels_ready,
        install_sample_starts=install_sample_starts,
        packing_note=PACKING_NOTE,
        kernels=KERNELS,
        snapshot=snapshot_writer(name) if published else None,
        backends={"automodel": AUTOMODEL_DENSE},
        description=f"{description} {HOW_TO_LOAD_VLM}",
    )


def qwen_moe_spec(name: str, source: ModelSource, hidden_size: int, description: str,
                  published: bool = False) -> ModelSpec:
    return ModelSpec(
        name=name,
        architecture="Qwen3_5MoeForCausalLM",
        sentinels=SENTINELS.name,
        source=source,
        hidden_size=hidden_size,
        lora_target_modules=FULL_ATTENTION + LINEAR_ATTENTION + SHARED_EXPERT,
        lora_exclusions=MOE_EXCLUSIONS,
        state_dict_adapter=VLM_TO_TEXT.name,
        supports_packing=False,
        packing_when=varlen_kernels_ready,
        install_sample_starts=install_sample_starts,
        packing_note=PACKING_NOTE,
        kernels=KERNELS,
        snapshot=snapshot_writer(name) if published else None,
        backends={"automodel": AUTOMODEL_MOE},
        description=f"{description} {HOW_TO_LOAD_VLM}",
    )


# What stitch-qwen[kernels] installs, import name -> distribution: fla for Gated DeltaNet's fused path (transformers
# picks it up when importable; stitch adds the varlen conv and packing; Triton >= 3.7.1 on Hopper), liger for the
# RMSNorms, SwiGLU MLPs and RoPE. causal-conv1d's CUDA build is optional: without it the unpacked conv is cuDNN's.
KERNELS_EXTRA = "stitch-qwen[kernels]"
KERNELS = {"fla": "flash-linear-attention", "liger_kernel": "liger-kernel"}

DEMO_PACKING_NOTE = (
    "full-attention layers only: packed rows get a block-causal mask from position-id resets "
    "(with use_cache=False), so no token attends across a sample boundary"
)


def qwen_demo_spec() -> ModelSpec:
    """The CPU demo base: Qwen3.5's class and tokenizer family, attention-only so it can pack, pre-trained."""
    return ModelSpec(
        name="qwen3.5-demo",
        architecture="Qwen3_5ForCausalLM",
        sentinels=SENTINELS.name,
        source=ModelSource(builder=build_qwen35_demo, builder_key="qwen3.5-demo-v5",
                            tokenizer_builder=write_tokenizer),
        hidden_size=TINY_HIDDEN,
        lora_target_modules=FULL_ATTENTION,
        lora_exclusions={
            **DENSE_EXCLUSIONS,
            "linear attention": "this preset has no Gated DeltaNet layers (attention-only, so it packs)",
        },
        state_dict_adapter=VLM_TO_TEXT.name,
        supports_packing=True,
        install_sample_starts=install_fused_kernels,  # packs natively; this only adds the fused kernels
        packing_note=DEMO_PACKING_NOTE,
        description="Tiny Qwen3.5-class LM (2 full-attention layers), pre-trained on task-style text: the "
        "CPU demo's base. Built locally in about 20 s on first use.",
    )


MODELS: tuple[ModelSpec, ...] = (
    qwen_dense_spec(
        "qwen3.5-4b",
        ModelSource(repo_id="Qwen/Qwen3.5-4B", revision="851bf6e806efd8d0a36b00ddf55e13ccb7b8cd0a"),
        2560,  # published (docs/models.md)
        "Qwen3.5-4B, dense hybrid (Gated DeltaNet + full attention); shipped as a native VLM whose own vision "
        "tower stays frozen and unused; images arrive as 'clip_image' soft tokens.",
        published=True,
    ),
    qwen_moe_spec(
        "qwen3.6-35b-a3b",
        ModelSource(repo_id="Qwen/Qwen3.6-35B-A3B", revision="995ad96eacd98c81ed38be0c5b274b04031597b0"),
        2048,  # published (docs/models.md)
        "Qwen3.6-35B-A3B, hybrid MoE (routed experts + one shared expert per layer); native VLM checkpoint, "
        "vision tower frozen and unused; images arrive as 'clip_image' soft tokens.",
        published=True,
    ),
    qwen_dense_spec(
        "qwen3.5-tiny",
        ModelSource(builder=build_qwen35_tiny, builder_key="qwen3.5-tiny-v3"),
        TINY_HIDDEN,
        "Tiny random-init Qwen3.5 (1 linear-attention + 1 full-attention layer) for tests.",
    ),
    qwen_moe_spec(
        "qwen3.5-moe-tiny",
        ModelSource(builder=build_qwen35_moe_tiny, builder_key="qwen3.5-moe-tiny-v3"),
        TINY_HIDDEN,
        "Tiny random-init Qwen3.5-MoE (linear + full attention, 4 routed experts + shared expert) for tests.",
    ),
    qwen_demo_spec(),
)
