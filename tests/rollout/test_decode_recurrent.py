"""The fixed-cache decoder on the seed-model families (the tiny presets, fp32): Qwen3.5's Gated DeltaNet hybrid, its
MoE hybrid, Nemotron-H's Mamba-2 hybrid and its MoE hybrid. Greedy tokens and log-probs are ``generate``'s on every
row with several samples per left-padded prompt, sampled tokens are ``generate``'s from the same seed, a decode step
reads nothing back from the device (MoE routing included), and on a GPU the captured step gives ``generate``'s rows."""

from __future__ import annotations

import functools

import pytest
import torch

from stitch.rollout import decode
from stitch.rollout.engines import EmbeddedEngine
from tests.rollout.test_decode_static import PAD, SUPPRESS, prompts
from tests.stitch_testing import DeviceReads

pytest.importorskip("stitch_qwen", reason="the Qwen3.5 presets come from the stitch-qwen plugin")
pytest.importorskip("stitch_nemotron", reason="the Nemotron-H presets come from the stitch-nemotron plugin")

# preset -> whether it has routed experts
FAMILIES = {
    "qwen3.5-tiny": False,  # Gated DeltaNet + full attention
    "qwen3.5-moe-tiny": True,  # the same with MoE blocks
    "nemotron-nano-tiny": False,  # Mamba-2, MLP, attention, MLP
    "nemotron-lightning-tiny": True,  # Mamba-2, MoE, attention, MoE
}
# 2 tokens is shorter than the 4-tap conv window: its window starts with zeros, as in transformers' cache
LENGTHS = (9, 2, 13)


@functools.cache
def family_lm(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """The preset's LM loaded as stitch loads it, with a LoRA adapter that acts on the spec's targets (B non-zero),
    wrapped as GRPO's policy is (StitchedModel switches attention to stitch_varlen)."""
    from peft import LoraConfig, get_peft_model

    from stitch.host.host import load_plugins
    from stitch.model.loading import load_model
    from stitch.model.stitched import StitchedModel

    host = load_plugins()
    spec = host.get("models", name)
    lm = load_model(spec, dtype=dtype, registry=host).to(device)
    lm.requires_grad_(False)
    torch.manual_seed(0)
    lm = get_peft_model(lm, LoraConfig(r=4, lora_alpha=8, target_modules=list(spec.lora_target_modules),
                                       init_lora_weights=False))
    text = lm.config.get_text_config()
    StitchedModel(lm, torch.nn.Linear(8, text.hidden_size).to(device, dtype), placeholder_id=text.vocab_size - 1)
    return lm.eval()


def engines(lm, eos: int = 3):
    return (EmbeddedEngine(lm, pad_id=PAD, eos_id=eos, suppress_ids=SUPPRESS),
            EmbeddedEngine(lm, pad_id=PAD, eos_id=eos, suppress_ids=SUPPRESS, static_decode=False))


def assert_rows_equal(ours, theirs, atol: float) -> None:
    assert [c.prompt_index for c in ours] == [c.prompt_index for c in theirs]
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=atol, rtol=0)
        assert not set(a.token_ids) & set(SUPPRESS)


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_tokens_and_logprobs_equal_generate_on_every_row_of_several_samples_per_left_padded_prompt(name):
    """generate refuses greedy with several sequences per prompt, so each of our n rows of a prompt is compared with
    generate's one row of it: every sample starts from its prompt's replicated KV and recurrent states."""
    lm = family_lm(name)
    fast, stock = engines(lm)
    assert fast.decoder is not None, fast.decode_path
    embeds = prompts(lm, lengths=LENGTHS)
    ours = fast.generate(embeds, 2, 14, greedy=True)
    theirs = [c for c in stock.generate(embeds, 1, 14, greedy=True) for _ in range(2)]
    assert [c.prompt_index for c in ours] == [0, 0, 1, 1, 2, 2]
    assert_rows_equal(ours, theirs, atol=1e-5)
    assert len({tuple(c.token_ids) for c in ours}) == 3  # the prompts lead somewhere different
    (step,) = fast.decoder._steps.values()
    kinds = lm.config.get_text_config().layer_types
    assert sorted(step.cache.layers) == [i for i, kind in enumerate(kinds) if kind == "linear_attention"]
    for layer in step.cache.layers.values():
        assert sorted(layer.buffers()) == ["conv", "recurrent"]
        assert all(buf.shape[0] == 6 for buf in layer.buffers().values())
    assert step.experts_implementation == ("grouped_mm" if FAMILIES[name] else None)


@pytest.mark.parametrize("name", FAMILIES)
def test_sampling_at_temperature_one_draws_generates_tokens_from_the_same_seed(name):
    lm = family_lm(name)
    fast, stock = engines(lm)
    embeds = prompts(lm, lengths=LENGTHS, seed=2)
    torch.manual_seed(7)
    ours = fast.generate(embeds, 3, 12, temperature=1.0)
    torch.manual_seed(7)
    theirs = stock.generate(embeds, 3, 12, temperature=1.0)
    assert [c.prompt_index for c in ours] == [0] * 3 + [1] * 3 + [2] * 3
    assert_rows_equal(ours, theirs, atol=1e-5)
    assert len({tuple(c.token_ids) for c in ours}) > 3


@pytest.mark.parametrize("name", FAMILIES)
def test_a_decode_step_reads_nothing_back_from_the_device_so_it_can_be_captured(name):
    """Attention, the recurrent state updates and MoE routing (transformers' grouped experts, switched on for the
    step; the model's eager expert loop reads the routing back with nonzero and item) run without a device read."""
    lm = family_lm(name)
    decoder = decode.StaticDecoder(lm, use_graphs=False)
    fast = EmbeddedEngine(lm, PAD, 3, SUPPRESS)
    fast.decoder = decoder
    fast.generate(prompts(lm, lengths=LENGTHS), 2, 3, greedy=True)
    (step,) = decoder._steps.values()
    with DeviceReads() as reads:
        logits = step()
    assert reads.found == []
    assert logits.shape == (6, lm.config.get_text_config().vocab_size)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("name", FAMILIES)
def test_on_a_gpu_graphed_fp32_decode_of_each_family_gives_generates_greedy_tokens_and_logprobs_on_every_row(name):
    """The captured step (KV and state slots updated in place, MoE on batched_mm in fp32) against generate: in fp32
    there are no near-tie flips, so every row must be generate's."""
    lm = family_lm(name, "cuda")
    fast, stock = engines(lm)
    embeds = prompts(lm, lengths=(9, 2, 13, 7, 11, 5))
    ours = fast.generate(embeds, 2, 24, greedy=True)
    theirs = [c for c in stock.generate(embeds, 1, 24, greedy=True) for _ in range(2)]
    assert fast.decoder._steps and all(step.graph is not None for step in fast.decoder._steps.values())
    assert_rows_equal(ours, theirs, atol=1e-4)
    assert len({tuple(c.token_ids) for c in ours}) > 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("name", [name for name, moe in FAMILIES.items() if moe])
def test_on_a_gpu_a_bf16_moe_step_captures_grouped_experts_and_replays_what_the_eager_step_computes(name):
    """In bf16, the dtype rollouts run in, the step's experts are transformers' grouped_mm (torch's grouped GEMM
    over device-side offsets) inside the captured graph; its replay samples the eager fixed-cache decoder's tokens."""
    from stitch.rollout.engines import left_pad

    lm = family_lm(name, "cuda", torch.bfloat16)
    embeds = prompts(lm, lengths=LENGTHS)
    batch, mask = left_pad(embeds, lm.get_input_embeddings()(torch.tensor([PAD], device="cuda"))[0])
    graphed, eager = decode.StaticDecoder(lm, use_graphs=True), decode.StaticDecoder(lm, use_graphs=False)
    torch.manual_seed(3)
    a = graphed.decode(batch, mask, 4, 20, eos_id=3, pad_id=PAD, suppress_ids=SUPPRESS)
    torch.manual_seed(3)
    b = eager.decode(batch, mask, 4, 20, eos_id=3, pad_id=PAD, suppress_ids=SUPPRESS)
    (step,) = graphed._steps.values()
    assert a.graph and not b.graph and step.experts_implementation == "grouped_mm"
    assert torch.equal(a.tokens, b.tokens)
    assert torch.allclose(a.logprobs, b.logprobs, atol=1e-3, rtol=0)
