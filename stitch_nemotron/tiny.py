"""Tiny Nemotron-H snapshots (Nano-shaped and Lightning-shaped) built locally, seeded and in safetensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from stitch.api import chatml_template, padded_vocab_size, train_tokenizer
from stitch_nemotron.sentinels import SENTINELS

TINY_HIDDEN = 128
SEED = 0
UNK, BOS, EOS_DOC, IM_START, IM_END = "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (UNK, BOS, EOS_DOC, IM_START, IM_END, *SENTINELS.tokens)
VIDEO_TOKENS = (SENTINELS.video_start, SENTINELS.video_end)  # after the trained vocabulary: no existing id moves


def config_kwargs(tokenizer_dir: Path, layers: list[str]) -> dict[str, Any]:
    """Shape shared by both presets: Mamba-2 (4 heads x 32), GQA attention with head dim 64."""
    from transformers import AutoTokenizer  # deferred: plugin loading skips transformers

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return {
        "vocab_size": padded_vocab_size(tokenizer_dir),
        "hidden_size": TINY_HIDDEN,
        "layers_block_type": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,  # vLLM rejects head dim 32
        "intermediate_size": 256,
        "mamba_num_heads": 4,
        "mamba_head_dim": 32,
        "n_groups": 1,
        "ssm_state_size": 16,
        "chunk_size": 16,
        "conv_kernel": 4,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }


def write_snapshot(out_dir: Path, layers: list[str], **extra: Any) -> None:
    from transformers import GenerationConfig, NemotronHConfig  # deferred: plugin loading skips transformers

    from stitch_nemotron.generation import NemotronHForCausalLM  # deferred: plugin loading skips transformers

    train_tokenizer(
        out_dir,
        SPECIAL_TOKENS,
        eos_token=IM_END,
        pad_token=UNK,
        bos_token=BOS,
        chat_template=chatml_template(IM_START, IM_END),
        appended_tokens=VIDEO_TOKENS,
    )
    config = NemotronHConfig(**config_kwargs(out_dir, layers), **extra)
    torch.manual_seed(SEED)
    model = NemotronHForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        do_sample=False,
    )
    model.save_pretrained(out_dir)


def build_nano_tiny(out_dir: Path) -> None:
    """Nano-shaped: Mamba-2, MLP, attention, MLP blocks."""
    write_snapshot(out_dir, ["linear_attention", "mlp", "full_attention", "mlp"])


def build_lightning_tiny(out_dir: Path) -> None:
    """Lightning-shaped: Mamba-2, MoE, attention, MoE blocks; 4 routed experts (top-2) plus a shared expert."""
    write_snapshot(
        out_dir,
        ["linear_attention", "moe", "full_attention", "moe"],
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        moe_shared_expert_intermediate_size=64,
        n_group=1,
        topk_group=1,
    )
