"""Nemotron-3-Nano-4B and Nemotron-3.5-Lightning-30B-A3B in their published checkpoint layout (``backbone.*``, one
tensor per routed expert), as random-init snapshots written shard by shard; shapes and sources in docs/models.md."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from stitch.api import (
    chatml_template,
    padded_vocab_size,
    shrink_layer_pattern,
    train_tokenizer,
    write_random_weights,
)
from stitch_nemotron.sentinels import SENTINELS

# The published tokenizer is not vendored in any installed package: a snapshot carries a small trained BPE with
# the family's control tokens (<unk>/<s>/</s>, ChatML markers, think tags) and the <SPECIAL_N> sentinels.
UNK, BOS, EOS_DOC, IM_START, IM_END = "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (UNK, BOS, EOS_DOC, IM_START, IM_END, "<think>", "</think>", *SENTINELS.tokens)

# hybrid_override_pattern letters as the published config.json spells them -> transformers' block names
BLOCKS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
LETTER_OF = {block: letter for letter, block in BLOCKS.items()}

COMMON: dict[str, Any] = {
    "vocab_size": 131072,
    "head_dim": 128,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "mlp_hidden_act": "relu2",
    "layer_norm_epsilon": 1e-5,
    "tie_word_embeddings": False,
    "max_position_embeddings": 262144,
    "use_conv_bias": True,
    "mamba_proj_bias": False,
    "attention_bias": False,
}
PUBLISHED: dict[str, dict[str, Any]] = {
    "nemotron-3-nano-4b": {**COMMON, "hidden_size": 3136, "pattern": "M-M-M-MM-M-M*-M-M*-M-M-M*-M-M-MM*-MMM-M-M-",
                           "num_attention_heads": 40, "num_key_value_heads": 8, "intermediate_size": 12544,
                           "mamba_num_heads": 96, "mamba_head_dim": 80, "chunk_size": 256},
    # Lightning's geometry is read from two public ports of the checkpoint (docs/models.md); routing constants,
    # chunk size and the dense intermediate size were not found and are Nemotron-3-Nano-30B-A3B's published ones.
    "nemotron-3.5-lightning-30b-a3b": {
        **COMMON, "hidden_size": 2688, "pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        "num_attention_heads": 32, "num_key_value_heads": 2, "intermediate_size": 1856, "mamba_num_heads": 64,
        "mamba_head_dim": 64, "chunk_size": 128, "n_routed_experts": 128, "n_shared_experts": 1,
        "num_experts_per_tok": 6, "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712,
        "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1, "norm_topk_prob": True},
}
NARROW: dict[str, Any] = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "mamba_num_heads": 4,
                          "mamba_head_dim": 32, "n_groups": 1, "ssm_state_size": 16, "chunk_size": 16}
NARROW_MOE: dict[str, Any] = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                              "moe_shared_expert_intermediate_size": 64}


def shape(name: str, layers: int | None = None, width: int | None = None) -> dict[str, Any]:
    """The published config of ``name`` (``pattern`` = hybrid_override_pattern); ``layers`` keeps that many blocks
    (every block type kept), ``width`` narrows the model to that hidden size (for tests)."""
    out = dict(PUBLISHED[name])
    if layers is not None:
        out["pattern"] = "".join(shrink_layer_pattern(list(out["pattern"]), layers))
    if width is not None:
        out.update(NARROW, hidden_size=width, intermediate_size=2 * width)
        if "n_routed_experts" in out:
            out.update(NARROW_MOE)
    return out


def published_config_json(config: Any) -> dict[str, Any]:
    """``config`` as the published config.json spells it: ``hybrid_override_pattern`` and ``num_hidden_layers``
    instead of transformers' ``layers_block_type`` list (which transformers derives from them on load)."""
    data = config.to_dict()
    blocks = data.pop("layers_block_type")
    data["hybrid_override_pattern"] = "".join(LETTER_OF[b] for b in blocks)
    data["num_hidden_layers"] = len(blocks)
    data.pop("mtp_layers_block_type", None)
    return data


def write_published_snapshot(name: str, out_dir: Path, layers: int | None = None, width: int | None = None,
                             dtype: Any = None, **weight_options: Any) -> None:
    """config.json, tokenizer and seeded random weights of ``name`` under the published key names."""
    from transformers import AutoTokenizer, NemotronHConfig  # deferred: plugin loading skips transformers

    from stitch_nemotron.generation import NemotronHForCausalLM  # deferred: plugin loading skips transformers

    dtype = dtype or torch.bfloat16
    out_dir = Path(out_dir)
    train_tokenizer(out_dir, SPECIAL_TOKENS, eos_token=IM_END, pad_token=UNK, bos_token=BOS,
                    chat_template=chatml_template(IM_START, IM_END))
    tok = AutoTokenizer.from_pretrained(out_dir)
    values = shape(name, layers, width)
    pattern = values.pop("pattern")
    if width is not None:
        values["vocab_size"] = padded_vocab_size(out_dir)
    config = NemotronHConfig(**values, layers_block_type=[BLOCKS[c] for c in pattern],
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                             bos_token_id=tok.bos_token_id, num_nextn_predict_layers=0)
    config.architectures = ["NemotronHForCausalLM"]
    config.dtype = dtype
    with torch.device("meta"):
        model = NemotronHForCausalLM(config).to(dtype)
    # transformers loads Nemotron-H checkpoints by renaming backbone.* to model.*, and does not rename back on save
    write_random_weights(model, out_dir, rename=lambda key: "backbone." + key[len("model."):]
                         if key.startswith("model.") else key, **weight_options)
    if not weight_options.get("dry_run"):
        (out_dir / "config.json").write_text(json.dumps(published_config_json(config), indent=2, default=str) + "\n")


def snapshot_writer(name: str) -> Callable[..., None]:
    """``ModelSpec.snapshot`` for ``name``: ``write(out_dir, layers=None, width=None, dtype=None, **options)``, the
    options those of ``write_random_weights`` (``progress``, ``max_shard_bytes``, ``dry_run``, ``spill_dir``...)."""

    def write(out_dir: Path, **options: Any) -> None:
        write_published_snapshot(name, out_dir, **options)

    return write
