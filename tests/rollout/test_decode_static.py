"""The embedded engine's fixed-cache decoder gives what transformers ``generate`` gives: the same greedy tokens and
log-probs, the same sampled tokens from the same seed, the same stop at EOS, on left-padded prompts of several
lengths; what it cannot serve keeps ``generate``. The CUDA-graph replay is checked against the eager decoder
on a GPU."""

from __future__ import annotations

import pytest
import torch

from stitch.rollout import decode
from stitch.rollout.engines import EmbeddedEngine

PAD, SUPPRESS = 0, (5, 6, 7)


def tiny_lm(kind: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """A random-init tiny LM with a LoRA adapter that acts (B non-zero), wrapped as GRPO's policy is (StitchedModel
    switches attention to stitch_varlen and LoRA to half compute where the LM is half precision)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    from stitch.model.stitched import StitchedModel

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True)
    if kind == "qwen3":
        cfg, cls = transformers.Qwen3Config(**common), transformers.Qwen3ForCausalLM
    elif kind == "qwen3_5_attention":
        cfg = transformers.Qwen3_5TextConfig(**common, layer_types=["full_attention"] * 2)
        cls = transformers.Qwen3_5ForCausalLM
    else:
        cfg = transformers.Qwen3_5TextConfig(**common, layer_types=["linear_attention", "full_attention"],
                                             linear_num_key_heads=2, linear_num_value_heads=2,
                                             linear_key_head_dim=16, linear_value_head_dim=16)
        cls = transformers.Qwen3_5ForCausalLM
    torch.manual_seed(0)
    lm = cls._from_config(cfg, dtype=dtype, attn_implementation="sdpa").to(device)
    lm.requires_grad_(False)
    lm = get_peft_model(lm, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                       init_lora_weights=False))
    StitchedModel(lm, torch.nn.Linear(8, 64).to(device, dtype), placeholder_id=95)
    return lm.eval()


def prompts(lm, lengths=(9, 4, 13), seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    embed = lm.get_input_embeddings()
    device = embed.weight.device
    return [embed(torch.randint(10, 90, (n,), generator=gen).to(device)) for n in lengths]


def engines(lm, eos: int = 3):
    return (EmbeddedEngine(lm, pad_id=PAD, eos_id=eos, suppress_ids=SUPPRESS),
            EmbeddedEngine(lm, pad_id=PAD, eos_id=eos, suppress_ids=SUPPRESS, static_decode=False))


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5_attention"])
def test_fixed_cache_greedy_tokens_and_logprobs_equal_generate_on_left_padded_prompts(kind):
    lm = tiny_lm(kind)
    fast, stock = engines(lm)
    assert fast.decoder is not None and stock.decoder is None
    embeds = prompts(lm)
    ours = fast.generate(embeds, 1, 16, greedy=True)
    theirs = stock.generate(embeds, 1, 16, greedy=True)
    assert [c.prompt_index for c in ours] == [c.prompt_index for c in theirs] == [0, 1, 2]
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    assert len({tuple(c.token_ids) for c in ours}) > 1  # the prompts lead somewhere different
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
        assert not set(a.token_ids) & set(SUPPRESS)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5_attention"])
def test_fixed_cache_sampling_draws_the_tokens_generate_draws_from_the_same_seed(kind):
    lm = tiny_lm(kind)
    fast, stock = engines(lm)
    embeds = prompts(lm)
    torch.manual_seed(7)
    ours = fast.generate(embeds, 4, 12, temperature=0.8)
    torch.manual_seed(7)
    theirs = stock.generate(embeds, 4, 12, temperature=0.8)
    assert [c.prompt_index for c in ours] == [c.prompt_index for c in theirs] == [0] * 4 + [1] * 4 + [2] * 4
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    assert len({tuple(c.token_ids) for c in ours}) > 3
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_fixed_cache_stops_each_row_at_eos_as_generate_does():
    lm = tiny_lm("qwen3")
    embeds = prompts(lm)
    free = EmbeddedEngine(lm, pad_id=PAD, eos_id=95, suppress_ids=SUPPRESS).generate(embeds, 1, 16, greedy=True)
    eos = free[0].token_ids[5]  # a token row 0 reaches mid-way: it must end there, the others where they reach it
    fast, stock = engines(lm, eos=eos)
    ours, theirs = fast.generate(embeds, 1, 16, greedy=True), stock.generate(embeds, 1, 16, greedy=True)
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    assert ours[0].token_ids[-1] == eos and len(ours[0].token_ids) <= 6


def test_gated_deltanet_hybrids_decode_on_the_fixed_cache_and_the_remaining_refusals_keep_generate():
    """Recurrent layers qualify now (tests/rollout/test_decode_recurrent.py checks them against generate); eager attention,
    sliding-window layers, model types never checked and experts without transformers' implementation switch keep
    generate, and the engine says why."""
    import transformers

    hybrid = tiny_lm("qwen3_5_hybrid")
    assert decode.static_decode_unsupported(hybrid) is None
    assert EmbeddedEngine(hybrid, PAD, 3).decode_path == "fixed-cache decode"
    hybrid.get_base_model().set_attn_implementation("eager")
    engine = EmbeddedEngine(hybrid, PAD, 3)
    assert engine.decoder is None and "attention 'eager'" in engine.decode_path

    small = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16)
    sliding = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **small, use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention", "full_attention"]))
    assert "layer types ['sliding_attention']" in decode.static_decode_unsupported(sliding)
    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(**small))
    assert "model type 'mistral' is not one" in decode.static_decode_unsupported(mistral)

    moe = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(
        **small, layer_types=["full_attention"] * 2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16))
    assert decode.static_decode_unsupported(moe) is None

    class LoopExperts(torch.nn.Module):  # an expert loop of its own: nothing switches it to grouped GEMMs
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return hidden_states

    moe.model.layers[1].mlp.experts = LoopExperts()
    assert "LoopExperts has no transformers experts-implementation switch" in decode.static_decode_unsupported(moe)


def test_a_graph_is_captured_once_per_shape_and_reused_across_calls(monkeypatch):
    lm = tiny_lm("qwen3")
    decoder = decode.StaticDecoder(lm, use_graphs=False)
    built = []
    original = decode.DecodeStep.__init__

    def counting(self, *args, **kwargs):
        built.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(decode.DecodeStep, "__init__", counting)
    engine = EmbeddedEngine(lm, PAD, 3, SUPPRESS)
    engine.decoder = decoder
    first = engine.generate(prompts(lm), 2, 8)
    again = engine.generate(prompts(lm, lengths=(10, 3, 12)), 2, 8)  # same width 13: same step
    assert len(built) == 1 and len(decoder._steps) == 1
    assert first[0].token_ids != again[0].token_ids or first[2].token_ids != again[2].token_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_equals_the_eager_fixed_cache_decoder_on_a_gpu():
    lm = tiny_lm("qwen3", dtype=torch.bfloat16, device="cuda")
    embeds = prompts(lm)
    graphed = decode.StaticDecoder(lm, use_graphs=True)
    eager = decode.StaticDecoder(lm, use_graphs=False)
    from stitch.rollout.engines import left_pad

    pad = lm.get_input_embeddings()(torch.tensor([PAD], device="cuda"))[0]
    batch, mask = left_pad(embeds, pad)
    torch.manual_seed(3)
    a = graphed.decode(batch, mask, 4, 24, eos_id=3, pad_id=PAD, suppress_ids=SUPPRESS)
    torch.manual_seed(3)
    b = eager.decode(batch, mask, 4, 24, eos_id=3, pad_id=PAD, suppress_ids=SUPPRESS)
    assert a.graph and not b.graph
    assert torch.equal(a.tokens, b.tokens)
    assert torch.allclose(a.logprobs, b.logprobs, atol=1e-3, rtol=0)
    stock = EmbeddedEngine(lm, PAD, 3, SUPPRESS, static_decode=False).generate(embeds, 1, 24, greedy=True)
    a = graphed.decode(batch, mask, 1, 24, eos_id=3, pad_id=PAD, suppress_ids=SUPPRESS, greedy=True)
    same = sum(c.token_ids == a.tokens[i, : len(c.token_ids)].tolist() for i, c in enumerate(stock))
    assert same >= len(stock) - 2  # bf16 near-ties may flip a row; the rest match generate exactly


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_on_a_gpu_graphed_fp32_decode_gives_generates_greedy_tokens_and_logprobs_on_every_row():
    """The bf16 test above compares the graph with the eager fixed-cache decoder (which shares its cache) and
    tolerates near-tie flips against generate; in fp32 there are none, so every row must be generate's."""
    lm = tiny_lm("qwen3", device="cuda")
    fast, stock = engines(lm)
    embeds = prompts(lm, lengths=(9, 4, 13, 7, 11, 5))
    ours = fast.generate(embeds, 1, 24, greedy=True)
    theirs = stock.generate(embeds, 1, 24, greedy=True)
    assert fast.decoder._steps and all(step.graph is not None for step in fast.decoder._steps.values())
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    assert len({tuple(c.token_ids) for c in ours}) > 1
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


def test_grouped_decode_attention_equals_sdpa_over_repeated_kv_heads_under_a_key_mask():
    from transformers.integrations.sdpa_attention import repeat_kv

    from stitch.kernels.attention import grouped_decode_applies, grouped_decode_attention

    gen = torch.Generator().manual_seed(0)
    rows, heads, kv, length, dim = 3, 8, 2, 11, 16
    q = torch.randn(rows, heads, 1, dim, generator=gen)
    k, v = (torch.randn(rows, kv, length, dim, generator=gen) for _ in range(2))
    mask = torch.rand(rows, 1, 1, length, generator=gen) > 0.4
    mask[..., 0] = True
    assert grouped_decode_applies(q, k, mask, 0.0)
    assert not grouped_decode_applies(q, k, None, 0.0) and not grouped_decode_applies(q, k.repeat(1, 4, 1, 1), mask, 0)
    reference = torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, 4), repeat_kv(v, 4), attn_mask=mask,
                                                                 scale=0.3)
    out = grouped_decode_attention(q, k, v, mask, 0.3)
    assert out.shape == (rows, 1, heads, dim)
    assert torch.allclose(out, reference.transpose(1, 2), atol=1e-6, rtol=0)


def test_rollout_folds_every_lora_layer_and_refolds_after_the_adapter_changes():
    """The decoder runs each LoRA layer on W + sBA; an optimizer step between rollouts must reach the next one:
    after the adapter changes in place, the fixed-cache tokens equal generate's on the new weights again."""
    lm = tiny_lm("qwen3")
    fast, stock = engines(lm)
    assert len(fast.decoder.merged.layers) == 4  # q_proj and v_proj of both layers
    base_before = {n: p.clone() for n, p in lm.named_parameters() if "base_layer" in n}
    embeds = prompts(lm)
    first = fast.generate(embeds, 1, 12, greedy=True)
    assert [c.token_ids for c in first] == [c.token_ids for c in stock.generate(embeds, 1, 12, greedy=True)]
    with torch.no_grad():  # what AdamW does to the adapter between two GRPO steps
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * 2.0)
    second = fast.generate(embeds, 1, 12, greedy=True)
    theirs = stock.generate(embeds, 1, 12, greedy=True)
    assert [c.token_ids for c in second] == [c.token_ids for c in theirs]
    assert [c.token_ids for c in second] != [c.token_ids for c in first]
    for a, b in zip(second, theirs, strict=True):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert all(torch.equal(p, base_before[n]) for n, p in lm.named_parameters() if "base_layer" in n)
    assert all(type(m).__name__.startswith("Merged") is False for m in fast.decoder.merged.layers)


def test_bf16_rollout_on_merged_weights_matches_the_unmerged_adapter_within_bf16_rounding():
    """In bf16 the LoRA layers are stitch's one-node half-compute layers; folded, they give the log-probs of the
    unfolded path to bf16 rounding (the folded weight is rounded once to bf16)."""
    lm = tiny_lm("qwen3", dtype=torch.bfloat16)
    merged = EmbeddedEngine(lm, pad_id=PAD, eos_id=3, suppress_ids=SUPPRESS)
    plain = EmbeddedEngine(lm, pad_id=PAD, eos_id=3, suppress_ids=SUPPRESS)
    plain.decoder = decode.StaticDecoder(lm, merge_adapters=False)
    assert len(merged.decoder.merged.layers) == 4
    embeds = prompts(lm)
    ours, theirs = merged.generate(embeds, 1, 6, greedy=True), plain.generate(embeds, 1, 6, greedy=True)
    assert ours[0].token_ids[0] == theirs[0].token_ids[0]
    firsts = torch.tensor([c.logprobs[0] for c in ours]), torch.tensor([c.logprobs[0] for c in theirs])
    assert torch.allclose(*firsts, atol=0.05, rtol=0)
