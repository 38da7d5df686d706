"""stitch-qwen and stitch-nemotron: tiny presets, generation from embeddings, sentinels, LoRA sets, VLM layout."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from stitch.data.sentinels import SentinelError, resolve_sentinels
from stitch.demo.tiny import padded_vocab_size
from stitch.host.host import get_host, load_plugins
from stitch.model.loading import load_model, load_tokenizer
from stitch.plugins.snapshot_cache import ensure_snapshot
from stitch.plugins.specs import ModelSource, SentinelSpec

REPO = Path(__file__).resolve().parents[2]
TINY = ("qwen3.5-tiny", "qwen3.5-moe-tiny", "nemotron-nano-tiny", "nemotron-lightning-tiny")
QWEN_TINY = ("qwen3.5-tiny", "qwen3.5-moe-tiny")
PROMPT = [[11, 25, 40, 7, 93, 120, 64]]


@pytest.fixture(scope="module")
def plugins():
    return load_plugins()


@pytest.fixture(scope="module")
def loaded(plugins):
    """name -> (spec, model, tokenizer), each tiny preset loaded once per module."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            spec = plugins.get("models", name)
            cache[name] = (spec, load_model(spec, registry=get_host()).eval(), load_tokenizer(spec))
        return cache[name]

    return get


def snapshot_dir(spec) -> Path:
    return ensure_snapshot(spec.source.builder_key, spec.source.builder)


def greedy_by_full_forward(model, embeds: torch.Tensor, steps: int, eos: int | None) -> list[int]:
    """Reference decoding: re-run the whole growing sequence each step (no cache), take the argmax."""
    ids: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(inputs_embeds=embeds).logits[:, -1].argmax(-1)
            ids.append(int(nxt))
            if eos is not None and int(nxt) == eos:
                break
            embeds = torch.cat([embeds, model.get_input_embeddings()(nxt)[:, None]], dim=1)
    return ids


# -- registration ---------------------------------------------------------------------------------


def declared(dist: str) -> dict[str, set[str]]:
    """What ``plugins/DIST/pyproject.toml`` declares the plugin registers: entry-point groups ``stitch.KIND``."""
    import tomllib

    project = tomllib.loads((REPO / "plugins" / dist / "pyproject.toml").read_text())["project"]
    return {group.removeprefix("stitch."): set(names) for group, names in project["entry-points"].items()
            if group.startswith("stitch.")}


@pytest.mark.parametrize("dist, entry_point",
                         [("stitch-qwen", "qwen"), ("stitch-nemotron", "nemotron"), ("stitch-clip", "clip")])
def test_plugin_registers_exactly_what_its_packaging_metadata_declares_stamped_with_itself(
    plugins, dist, entry_point
):
    """The declared names are what a lookup miss reads to say which distribution to install: they must not drift
    from what the plugin registers, in either direction."""
    kinds = declared(dist)
    assert kinds, f"{dist} declares nothing"
    for kind in {*kinds, *(reg.kind for reg in plugins.registrations() if reg.plugin == entry_point)}:
        stamped = {reg.name for reg in plugins.registrations(kind) if reg.plugin == entry_point}
        assert kinds.get(kind, set()) == stamped, f"{dist} {kind}: declared {kinds.get(kind)}, registered {stamped}"
    for reg in plugins.registrations("models"):
        if reg.plugin == entry_point:
            assert reg.spec.sentinels in plugins.names("token_sentinels")


def test_qwen_models_name_the_registered_vlm_to_text_adapter(plugins):
    assert "qwen3.5-vlm-to-text" in plugins.names("state_dict_adapters")
    for name in ("qwen3.5-4b", "qwen3.6-35b-a3b"):
        assert plugins.get("models", name).state_dict_adapter == "qwen3.5-vlm-to-text"


# -- tiny presets: load, forward, generate --------------------------------------------------------


@pytest.mark.parametrize("name", TINY)
def test_tiny_preset_is_a_safetensors_snapshot_loaded_by_from_pretrained_and_runs_forward(loaded, name):
    import transformers

    spec, model, tokenizer = loaded(name)
    snapshot = snapshot_dir(spec)
    assert (snapshot / "model.safetensors").exists() and not list(snapshot.glob("*.bin"))
    assert isinstance(model, getattr(transformers, spec.architecture))
    assert model.config.hidden_size == spec.hidden_size
    assert model.config.vocab_size == padded_vocab_size(snapshot) >= len(tokenizer)
    generation = json.loads((snapshot / "generation_config.json").read_text())
    assert (
        generation["eos_token_id"] == tokenizer.eos_token_id
        and generation["pad_token_id"] == tokenizer.pad_token_id
    )
    assert tokenizer.chat_template and tokenizer.eos_token_id != tokenizer.pad_token_id
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROMPT)).logits
    assert logits.shape == (1, len(PROMPT[0]), model.config.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.parametrize("name", TINY)
def test_generate_from_inputs_embeds_matches_a_manual_greedy_loop(loaded, name):
    _, model, tokenizer = loaded(name)
    embeds = model.get_input_embeddings()(torch.tensor(PROMPT)).detach()
    with torch.no_grad():
        generated = model.generate(inputs_embeds=embeds, max_new_tokens=10, do_sample=False)
    expected = greedy_by_full_forward(model, embeds, 10, tokenizer.eos_token_id)
    assert generated[0].tolist() == expected


def test_stock_nemotron_h_generate_refuses_inputs_embeds_which_is_why_the_plugin_subclasses_it(loaded):
    import transformers

    spec, _, _ = loaded("nemotron-nano-tiny")
    stock = transformers.NemotronHForCausalLM.from_pretrained(snapshot_dir(spec)).eval()
    embeds = stock.get_input_embeddings()(torch.tensor(PROMPT)).detach()
    with pytest.raises(ValueError, match="inputs_embeds"):
        stock.generate(inputs_embeds=embeds, max_new_tokens=2)


def test_nemotron_export_names_the_stock_architecture_so_it_loads_without_stitch(loaded, tmp_path):
    import transformers

    _, model, _ = loaded("nemotron-nano-tiny")
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["NemotronHForCausalLM"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(reloaded) is transformers.NemotronHForCausalLM


@pytest.mark.parametrize("name", ["qwen3.5-tiny", "nemotron-nano-tiny"])
def test_a_checkpoint_whose_hidden_size_differs_from_the_spec_is_refused(loaded, name):
    spec, _, _ = loaded(name)
    wrong = dataclasses.replace(spec, hidden_size=spec.hidden_size * 2)
    with pytest.raises(
        ValueError, match=rf"{name}.*hidden_size={spec.hidden_size * 2}.*hidden_size={spec.hidden_size}"
    ):
        load_model(wrong, registry=get_host())


@pytest.mark.parametrize("name", TINY)
def test_tiny_preset_build_is_deterministic(loaded, name, tmp_path):
    from safetensors.torch import load_file

    spec, _, _ = loaded(name)
    spec.source.builder(tmp_path)
    first = load_file(snapshot_dir(spec) / "model.safetensors")
    again = load_file(tmp_path / "model.safetensors")
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert (tmp_path / "tokenizer.json").read_text() == (snapshot_dir(spec) / "tokenizer.json").read_text()


# -- sentinels ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY)
def test_registered_sentinel_set_resolves_to_three_single_tokens_in_the_tiny_tokenizer(plugins, loaded, name):
    spec, _, tokenizer = loaded(name)
    sentinels = plugins.get("token_sentinels", spec.sentinels)
    ids = resolve_sentinels(sentinels, tokenizer)
    assert tokenizer.convert_ids_to_tokens([ids.start, ids.placeholder, ids.end]) == list(sentinels.tokens)
    assert set(sentinels.tokens) <= set(tokenizer.all_special_tokens)


def test_a_sentinel_that_is_several_tokens_is_refused_naming_the_token_and_the_tokenizer(loaded):
    spec, _, tokenizer = loaded("nemotron-nano-tiny")
    bogus = SentinelSpec(
        name="bogus", start="<SPECIAL_100>", placeholder="<|not_a_sentinel|>", end="<SPECIAL_102>"
    )
    with pytest.raises(SentinelError) as refused:
        resolve_sentinels(bogus, tokenizer)
    assert "<|not_a_sentinel|>" in str(refused.value) and str(snapshot_dir(spec)) in str(refused.value)


# -- LoRA target sets ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY)
def test_peft_accepts_the_lora_target_set_wraps_every_listed_family_and_merges_losslessly(plugins, name):
    from peft import LoraConfig, get_peft_model

    spec = plugins.get("models", name)
    model = load_model(spec, registry=get_host()).eval()
    linear_names = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=list(spec.lora_target_modules),
        target_parameters=list(spec.lora_target_parameters) or None,
        init_lora_weights=False,  # nonzero B, so the adapter changes the output and the merge is tested
    )
    peft_model = get_peft_model(model, config)
    wrapped = {
        n.removeprefix("base_model.model.") for n, m in peft_model.named_modules() if hasattr(m, "lora_A")
    }
    for family in spec.lora_target_modules:
        present = {n for n in linear_names if n == family or n.endswith("." + family)}
        assert present, f"{name}: target {family!r} matches no Linear in the model"
        assert present <= wrapped, f"{name}: peft left {sorted(present - wrapped)} without LoRA"
    assert wrapped == {
        n for n in linear_names if n.endswith(tuple("." + f for f in spec.lora_target_modules))
    }
    x = torch.tensor(PROMPT)
    with torch.no_grad():
        adapted = peft_model(input_ids=x).logits
        merged = peft_model.merge_and_unload()(input_ids=x).logits
    torch.testing.assert_close(merged, adapted, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("module", ["out_proj", "conv1d"])
def test_peft_refuses_lora_on_mamba_out_proj_and_conv1d_as_the_nemotron_exclusions_say(plugins, module):
    from peft import LoraConfig, get_peft_model

    spec = plugins.get("models", "nemotron-nano-tiny")
    assert any(module in family for family in spec.lora_exclusions)
    with pytest.raises(ValueError, match=module):
        get_peft_model(load_model(spec, registry=get_host()), LoraConfig(r=4, target_modules=["in_proj", module]))


@pytest.mark.parametrize(
    "name, experts", [("qwen3.5-moe-tiny", "mlp.experts"), ("nemotron-lightning-tiny", "mixer.experts")]
)
def test_routed_experts_are_fused_3d_parameters_and_excluded_while_the_shared_expert_is_targeted(
    loaded, name, experts
):
    spec, model, _ = loaded(name)
    fused = [p for n, p in model.named_parameters() if f".{experts}." in n]
    assert fused and all(p.ndim == 3 for p in fused)
    assert any(family.startswith(experts) for family in spec.lora_exclusions)
    assert any("shared_expert" in family for family in spec.lora_target_modules)
    assert not spec.lora_target_parameters


# -- packing --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY)
def test_packing_is_off_because_recurrent_state_leaks_across_reset_position_ids(loaded, name):
    spec, model, _ = loaded(name)
    first, second = [5, 9, 14, 22, 31], [40, 41, 7, 66, 80, 12]
    packed = torch.tensor([first + second])
    position_ids = torch.tensor([list(range(len(first))) + list(range(len(second)))])
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([second])).logits[0]
        # use_cache=False as in training: only then do attention layers get a block-causal mask from the
        # reset position_ids, so whatever still leaks is the recurrent (linear-attention / Mamba) state.
        in_pack = model(input_ids=packed, position_ids=position_ids, use_cache=False).logits[0, len(first) :]
    assert not torch.allclose(in_pack, alone, atol=1e-4), "samples no longer leak: packing could be enabled"
    assert spec.supports_packing is False and spec.packing_note


# -- the Qwen3.5 native VLM layout -----------------------------------------------------------------


def write_vlm_layout(text_snapshot: Path, out: Path, extra: dict[str, torch.Tensor] | None = None) -> Path:
    """A tiny snapshot in the native VLM layout: the text weights renamed, plus a vision tower and MTP head."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, Qwen3_5Config, Qwen3_5MoeConfig

    text_config = AutoConfig.from_pretrained(text_snapshot)
    vlm_cls = Qwen3_5MoeConfig if text_config.model_type == "qwen3_5_moe_text" else Qwen3_5Config
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 128}
    vlm_config = vlm_cls(text_config=text_config.to_dict(), vision_config=vision, tie_word_embeddings=True)
    out.mkdir(parents=True, exist_ok=True)
    vlm_config.save_pretrained(out)
    tensors = {
        "model.language_model." + k.removeprefix("model."): v
        for k, v in load_file(text_snapshot / "model.safetensors").items()
    }
    assert "lm_head.weight" not in tensors  # tied: the real small checkpoints ship no lm_head either
    tensors["model.visual.patch_embed.proj.weight"] = torch.randn(32, 3, 2, 16, 16)
    tensors["mtp.fc.weight"] = torch.randn(128, 256)
    tensors.update(extra or {})
    save_file(tensors, out / "model.safetensors")
    return out


@pytest.mark.parametrize("name", QWEN_TINY)
def test_vlm_layout_snapshot_loads_through_the_adapter_with_the_text_models_logits(loaded, name, tmp_path):
    spec, text_model, _ = loaded(name)
    vlm = write_vlm_layout(snapshot_dir(spec), tmp_path / "vlm")
    assert "text_config" in json.loads((vlm / "config.json").read_text())
    model = load_model(spec, source=ModelSource(local_path=str(vlm)), registry=get_host())
    assert type(model) is type(text_model)
    x = torch.tensor(PROMPT)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=x).logits, text_model(input_ids=x).logits, rtol=0, atol=0)


def test_vlm_adapter_refuses_a_key_it_cannot_place_by_name(loaded, plugins, tmp_path):
    spec, _, _ = loaded("qwen3.5-tiny")
    adapter = plugins.get("state_dict_adapters", "qwen3.5-vlm-to-text")
    with pytest.raises(ValueError, match=r"model\.mystery_head\.weight"):
        adapter.convert(
            {"model.language_model.norm.weight": torch.ones(2), "model.mystery_head.weight": torch.ones(2)}
        )
    vlm = write_vlm_layout(
        snapshot_dir(spec), tmp_path / "vlm", extra={"audio_tower.proj.weight": torch.ones(2)}
    )
    with pytest.raises(ValueError, match=r"audio_tower\.proj\.weight"):
        load_model(spec, source=ModelSource(local_path=str(vlm)), registry=get_host())


def test_vlm_adapter_maps_language_model_keys_and_drops_only_the_vision_tower_and_mtp_head(plugins):
    adapter = plugins.get("state_dict_adapters", "qwen3.5-vlm-to-text")
    converted = adapter.convert(
        {
            "model.language_model.layers.0.self_attn.q_proj.weight": 1,
            "model.language_model.embed_tokens.weight": 2,
            "lm_head.weight": 3,
            "model.visual.blocks.0.attn.qkv.weight": 4,
            "mtp.layers.0.mlp.gate_proj.weight": 5,
        }
    )
    assert converted == {
        "model.layers.0.self_attn.q_proj.weight": 1,
        "model.embed_tokens.weight": 2,
        "lm_head.weight": 3,
    }
