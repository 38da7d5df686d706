"""Qwen3.5-4B and Qwen3.6-35B-A3B in their published checkpoint layout (a conditional-generation VLM), as random-init
snapshots written shard by shard; every shape comes from docs/models.md, which cites its source."""

from __future__ import annotations

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
from stitch_qwen.sentinels import SENTINELS

# The published tokenizer is not vendored in any installed package (transformers' Qwen3_5Tokenizer ships code, no
# vocabulary), so a snapshot carries a small trained BPE holding the published special tokens and chat markers.
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END, *SENTINELS.tokens, "<|image_pad|>", "<|video_pad|>", "<think>", "</think>")

HYBRID_4 = ["linear_attention"] * 3 + ["full_attention"]  # 3 x Gated DeltaNet, then 1 x gated attention
COMMON: dict[str, Any] = {
    "vocab_size": 248320,
    "num_attention_heads": 16,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25},
}
TEXT: dict[str, dict[str, Any]] = {
    "qwen3.5-4b": {**COMMON, "hidden_size": 2560, "num_hidden_layers": 32, "layer_types": HYBRID_4 * 8,
                   "num_key_value_heads": 4, "intermediate_size": 9216, "tie_word_embeddings": True},
    "qwen3.6-35b-a3b": {**COMMON, "hidden_size": 2048, "num_hidden_layers": 40, "layer_types": HYBRID_4 * 10,
                        "num_key_value_heads": 2, "num_experts": 256, "num_experts_per_tok": 8,
                        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                        "tie_word_embeddings": False},
}
# Vision towers: stitch never reads them (the adapter drops model.visual.*), and their published shapes were not
# found apart from the depth of the small models; transformers' Qwen3_5VisionConfig defaults fill the rest.
VISION: dict[str, dict[str, Any]] = {"qwen3.5-4b": {"depth": 24}, "qwen3.6-35b-a3b": {}}
# --width: every other width-like dimension shrinks with it, so a test snapshot stays a few MB.
NARROW: dict[str, Any] = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "linear_num_key_heads": 2,
                          "linear_num_value_heads": 2, "linear_key_head_dim": 64, "linear_value_head_dim": 64}
NARROW_MOE: dict[str, Any] = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                              "shared_expert_intermediate_size": 64}
NARROW_VISION: dict[str, Any] = {"depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2}


def text_shape(name: str, layers: int | None = None, width: int | None = None) -> dict[str, Any]:
    """The published text-model config of ``name``; ``layers`` keeps that many layers (every layer type kept),
    ``width`` narrows the model to that hidden size (for tests)."""
    shape = dict(TEXT[name])
    if layers is not None:
        shape["layer_types"] = shrink_layer_pattern(shape["layer_types"], layers)
        shape["num_hidden_layers"] = layers
    if width is not None:
        shape.update(NARROW, hidden_size=width, intermediate_size=2 * width)
        if "num_experts" in shape:
            shape.update(NARROW_MOE)
    return shape


def build_config(name: str, tokenizer_dir: Path, layers: int | None, width: int | None) -> Any:
    """The published conditional-generation config; token ids are the snapshot tokenizer's own."""
    from transformers import (  # deferred: plugin loading skips transformers
        AutoTokenizer,
        Qwen3_5Config,
        Qwen3_5MoeConfig,
    )

    moe = "num_experts" in TEXT[name]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = text_shape(name, layers, width)
    if width is not None:  # narrow snapshots get a vocabulary the size of their tokenizer
        text["vocab_size"] = padded_vocab_size(tokenizer_dir)
    text.update(eos_token_id=tok.convert_tokens_to_ids(IM_END), pad_token_id=tok.pad_token_id, bos_token_id=None)
    vision = {**VISION[name], **(NARROW_VISION if width is not None else {}), "out_hidden_size": text["hidden_size"]}
    ids = {key: tok.convert_tokens_to_ids(token) for key, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", SENTINELS.start), ("vision_end_token_id", SENTINELS.end))}
    cls = Qwen3_5MoeConfig if moe else Qwen3_5Config
    config = cls(text_config=text, vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"], **ids)
    config.architectures = ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"]
    return config


def write_published_snapshot(name: str, out_dir: Path, layers: int | None = None, width: int | None = None,
                             dtype: Any = None, vocab_size: int | None = None, **weight_options: Any) -> None:
    """config.json, tokenizer and seeded random weights of ``name`` under the published key names
    (``model.language_model.*``, ``model.visual.*``, ``lm_head`` unless tied, routed experts one tensor each);
    ``vocab_size`` overrides the embedding rows (narrow snapshots otherwise get their tokenizer's size)."""
    import transformers  # deferred: plugin loading skips transformers

    dtype = dtype or torch.bfloat16
    out_dir = Path(out_dir)
    train_tokenizer(out_dir, SPECIAL_TOKENS, eos_token=IM_END, pad_token=PAD, chat_template=chatml_template())
    config = build_config(name, out_dir, layers, width)
    if vocab_size is not None:  # e.g. a narrow test model that keeps the published 248,320-row embedding
        config.text_config.vocab_size = vocab_size
    config.dtype = dtype
    with torch.device("meta"):
        model = getattr(transformers, config.architectures[0])(config).to(dtype)
    write_random_weights(model, out_dir, **weight_options)
    if not weight_options.get("dry_run"):
        config.save_pretrained(out_dir)


def snapshot_writer(name: str) -> Callable[..., None]:
    """``ModelSpec.snapshot`` for ``name``: ``write(out_dir, layers=None, width=None, dtype=None, **options)``, the
    options those of ``write_random_weights`` (``progress``, ``max_shard_bytes``, ``dry_run``, ``spill_dir``...)."""

    def write(out_dir: Path, **options: Any) -> None:
        write_published_snapshot(name, out_dir, **options)

    return write


def text_config(name: str) -> Any:
    """The published text-model config of ``name`` as transformers' config class, with the published vocabulary:
    what a memory estimate of the published shape builds on the meta device
    (``stitch.model.memory.spec_training_memory``)."""
    from transformers import (  # deferred: plugin loading skips transformers
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
    )

    shape = text_shape(name)
    return (Qwen3_5MoeTextConfig if "num_experts" in shape else Qwen3_5TextConfig)(**shape)
