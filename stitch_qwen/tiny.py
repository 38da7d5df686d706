"""Tiny Qwen3.5 snapshots (dense and MoE) built locally: trained tokenizer, seeded random weights, safetensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from stitch.api import chatml_template, padded_vocab_size, pretrain_in_place, train_tokenizer
from stitch_qwen.sentinels import SENTINELS

TINY_HIDDEN = 128
SEED = 0
EOS, PAD = "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = (PAD, "<|im_start|>", EOS, *SENTINELS.tokens)
# appended after the trained vocabulary: every id above, and so the demo base's pre-trained weights, stay as they were
VIDEO_TOKENS = (SENTINELS.video_start, SENTINELS.video_end)


def text_config_kwargs(tokenizer_dir: Path) -> dict[str, Any]:
    """Shape shared by both tiny presets: one Gated DeltaNet layer, one full-attention layer, head dim 64."""
    from transformers import AutoTokenizer  # deferred: plugin loading skips transformers

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return {
        "vocab_size": padded_vocab_size(tokenizer_dir),
        "hidden_size": TINY_HIDDEN,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"],
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,  # vLLM rejects head dim 32
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": None,
    }


def write_tokenizer(out_dir: Path) -> None:
    """The tiny presets' tokenizer (every Qwen tiny preset trains the same one): a preset's tokenizer_builder."""
    train_tokenizer(out_dir, SPECIAL_TOKENS, eos_token=EOS, pad_token=PAD, chat_template=chatml_template(),
                    appended_tokens=VIDEO_TOKENS)


def write_snapshot(out_dir: Path, config_cls: type, model_cls: type, **extra: Any) -> None:
    """Tokenizer + config (``extra`` overrides the shared shape) + seeded weights, saved to ``out_dir``."""
    from transformers import GenerationConfig  # deferred: plugin loading skips transformers

    write_tokenizer(out_dir)
    config = config_cls(**{**text_config_kwargs(out_dir), **extra})
    torch.manual_seed(SEED)
    model = model_cls(config)
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, do_sample=False
    )
    model.save_pretrained(out_dir)


def build_qwen35_tiny(out_dir: Path) -> None:
    """Dense hybrid: Qwen3_5ForCausalLM with linear and full attention."""
    from transformers import (  # deferred: plugin loading skips transformers
        Qwen3_5ForCausalLM,
        Qwen3_5TextConfig,
    )

    write_snapshot(out_dir, Qwen3_5TextConfig, Qwen3_5ForCausalLM)


def build_qwen35_moe_tiny(out_dir: Path) -> None:
    """MoE hybrid: Qwen3_5MoeForCausalLM, 4 routed experts (top-2) plus the shared expert in every layer."""
    from transformers import (  # deferred: plugin loading skips transformers
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
    )

    write_snapshot(
        out_dir,
        Qwen3_5MoeTextConfig,
        Qwen3_5MoeForCausalLM,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
    )


def write_qwen35_demo_init(out_dir: Path) -> None:
    """The demo base before its pre-training: Qwen3_5ForCausalLM with full-attention layers only (packable on every
    backend), seeded."""
    from transformers import (  # deferred: plugin loading skips transformers
        Qwen3_5ForCausalLM,
        Qwen3_5TextConfig,
    )

    write_snapshot(out_dir, Qwen3_5TextConfig, Qwen3_5ForCausalLM, layer_types=["full_attention"] * 2)


def build_qwen35_demo(out_dir: Path) -> None:
    """The demo base: ``write_qwen35_demo_init``, pre-trained on task-style chat text so LoRA + projector can learn
    in minutes on a CPU."""
    write_qwen35_demo_init(out_dir)
    pretrain_in_place(out_dir, SENTINELS.tokens, steps=300, batch_size=32)
