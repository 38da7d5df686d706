"""Decoding from prompt embeddings on a fixed-size cache: one prefill, then one decode step per token that runs as a
captured CUDA graph on a GPU (eagerly elsewhere), with transformers ``generate``'s sampling and stopping rules.

transformers' ``generate`` pays its Python and launch overhead on every token (a growing cache, a new mask, logits
processors): at 32-64 sequences of a 4B model a step costs ~30x its weight reads on a datacenter GPU. Here the
cache is preallocated (``stitch.rollout.slot_cache.SlotCache``: attention keys/values and the recurrent layers'
conv + recurrent states, one row per sequence), the mask is a boolean buffer updated in place, and the whole forward
of a step is one graph replay. Models qualify when their decoder layers are full attention that writes through
``past_key_values.update`` and reads a prepared mask dict, Gated DeltaNet or Mamba-2 layers that keep their states
through transformers' linear-attention cache interface, MLPs, or MoE blocks whose experts switch implementation
(``static_decode_unsupported`` says why not otherwise); the others keep ``generate``.

A MoE step routes on the device: its experts run transformers' ``grouped_mm`` (tokens sorted by expert, per-expert
counts from a histogram, one grouped GEMM over those offsets: no host sync, so the step captures) where torch's
grouped GEMM takes the weights without a host round trip, else ``batched_mm`` (``decode_experts_implementation``).

A LoRA layer costs a decode step several small kernels (casts, two rank-r products, the scaled add) for a
product that is ~1 % of its base GEMM: during a rollout the adapter is folded into a copy of each plain LoRA layer's
weight (``MergedAdapters``: W + s B A, in W's dtype, refreshed in place before every rollout, so captured graphs stay
valid), as vLLM serves a merged checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from stitch.kernels.attention import cache_kwarg, causal_lm
from stitch.rollout.slot_cache import SlotCache

log = logging.getLogger("stitch")

# model types whose decoder takes ``attention_mask={layer_type: mask}`` and ``position_ids`` as given, writes
# keys/values through ``past_key_values.update(k, v, layer_idx)`` and keeps recurrent states through
# ``has_previous_state`` / ``update_conv_state`` / ``update_recurrent_state`` / ``layers[i].{conv,recurrent}_states``
# (checked against generate in tests/test_decode_*)
MODEL_TYPES = ("qwen3", "qwen3_5_text", "qwen3_5_moe_text", "nemotron_h", "qwen2", "llama")
# decoder layer kinds the fixed-size cache serves: attention (KV slots), Gated DeltaNet / Mamba-2 (state slots),
# and the stateless MLP / MoE blocks of Nemotron-H
LAYER_KINDS = ("full_attention", "linear_attention", "mlp", "moe")
ATTENTION = ("sdpa", "stitch_varlen")  # both read a boolean mask; eager adds a float mask instead
GRAPHS_KEPT = 2  # captured step graphs kept per engine (each holds its cache and a small memory pool)


def routed_experts(lm: torch.nn.Module) -> tuple[list[torch.nn.Module], list[torch.nn.Module]]:
    """``lm``'s routed-expert modules (transformers names their classes ``*Experts``): those whose forward dispatches
    on ``config._experts_implementation`` (transformers' ``use_experts_implementation``), and the others."""
    switchable, fixed = [], []
    for module in lm.modules():
        if type(module).__name__.endswith("Experts"):
            switches = hasattr(module, "is_transposed") and hasattr(getattr(module, "config", None),
                                                                    "_experts_implementation")
            (switchable if switches else fixed).append(module)
    return switchable, fixed


def decode_experts_implementation(weight: torch.Tensor) -> str:
    """The transformers experts implementation a decode step runs for experts holding ``weight``: ``grouped_mm``
    (each expert's weight read once) where torch's grouped GEMM takes it with the group offsets on the device (CPU;
    CUDA bf16 from compute capability 8.0), else ``batched_mm`` (each routed token's expert weights gathered: more
    memory traffic, still no host sync). transformers' own ``grouped_mm`` falls back to a loop that copies the
    offsets to the host in the other cases, which a CUDA graph cannot capture."""
    if weight.device.type == "cpu":
        return "grouped_mm"
    grouped = hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")
    if (weight.is_cuda and weight.dtype == torch.bfloat16 and grouped
            and torch.cuda.get_device_capability(weight.device) >= (8, 0)):
        return "grouped_mm"
    return "batched_mm"


def static_decode_unsupported(lm: torch.nn.Module) -> str | None:
    """None when ``lm`` can decode on the fixed-size cache, else why it keeps transformers ``generate``."""
    base = causal_lm(lm)
    config = getattr(base, "config", None)
    if config is None:
        return f"{type(base).__name__} has no transformers config"
    text = config.get_text_config()
    if text.model_type not in MODEL_TYPES:
        return f"model type {text.model_type!r} is not one stitch's fixed-cache decoder was checked on {MODEL_TYPES}"
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    if not kinds <= set(LAYER_KINDS):
        return (f"layer types {sorted(kinds - set(LAYER_KINDS))}: the fixed-size cache holds attention keys/values "
                f"and Gated DeltaNet / Mamba-2 states only ({LAYER_KINDS}); sliding-window layers need "
                f"transformers' own cache")
    attn = getattr(config, "_attn_implementation", None)
    if attn not in ATTENTION:
        return f"attention {attn!r}: the fixed-cache decoder hands a boolean mask to sdpa"
    _, fixed = routed_experts(base)
    if fixed:
        return (f"{type(fixed[0]).__name__} has no transformers experts-implementation switch: its expert loop "
                f"reads the routing on the host, which a captured decode step cannot")
    return None


def _plain_lora_layer(module: torch.nn.Module) -> bool:
    """A peft LoRA ``Linear`` whose output is exactly ``base(x) + s B(A(x))`` with one active adapter (no dropout
    in eval, no DoRA or other variant, not merged, no transposed base weight)."""
    lora_a = getattr(module, "lora_A", None)
    names = getattr(module, "active_adapters", None)
    base = getattr(module, "base_layer", None)
    if not isinstance(lora_a, torch.nn.ModuleDict) or not names or len(names) != 1 or not isinstance(base, torch.nn.Linear):
        return False
    name = names[0]
    return (name in lora_a and name in module.lora_B and not module.disable_adapters and not module.merged
            and name not in getattr(module, "lora_variant", {}) and not getattr(module, "fan_in_fan_out", False)
            and (not module.training or isinstance(module.lora_dropout[name], torch.nn.Identity))
            and isinstance(lora_a[name], torch.nn.Linear) and lora_a[name].bias is None
            and module.lora_B[name].bias is None)


def _merged_forward(self: torch.nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    bias = self.base_layer.bias
    return F.linear(x, self._rollout_weight, None if bias is None else bias.to(x.dtype))


@functools.cache
def _merged_class(cls: type) -> type:
    return type(f"Merged{cls.__name__}", (cls,), {"forward": _merged_forward})


class MergedAdapters:
    """Rollout copies of ``lm``'s plain LoRA layers with the adapter folded in: ``W + s B A`` computed in fp32 and
    stored in the base weight's dtype, in buffers allocated once (their addresses are what a captured graph reads)
    and overwritten by ``refresh`` before each rollout. Inside ``active()`` those layers compute one GEMM on their
    merged weight; the trainer's weights and the adapter are never modified."""

    def __init__(self, lm: torch.nn.Module) -> None:
        self.layers = [m for m in lm.modules() if _plain_lora_layer(m)]
        self.weights: dict[torch.nn.Module, torch.Tensor] = {}

    @torch.no_grad()
    def refresh(self) -> None:
        for module in self.layers:
            name = module.active_adapters[0]
            base = module.base_layer.weight
            a, b = module.lora_A[name].weight, module.lora_B[name].weight
            merged = torch.addmm(base.float(), b.float(), a.float(), alpha=module.scaling[name])
            buffer = self.weights.get(module)
            if buffer is None:
                buffer = self.weights[module] = torch.empty_like(base)
            buffer.copy_(merged)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        layers = [m for m in self.layers if _plain_lora_layer(m)]  # a layer changed since: it runs as it is
        for module in layers:
            module._rollout_weight = self.weights[module]
            module.__class__ = _merged_class(type(module))
        try:
            yield
        finally:
            for module in layers:
                module.__class__ = type(module).__mro__[1]
                del module._rollout_weight


class DecodeStep:
    """One decode step of ``lm`` on static buffers: token ids -> logits of the next token, [rows, vocab].

    ``tokens``, ``positions``, ``key_valid`` and the cache's ``slots`` are the inputs, written in place between
    steps, and the recurrent layers update their state slots in place; on CUDA the forward is captured once as a
    graph and each call replays it. Routed experts run ``decode_experts_implementation`` inside the step."""

    def __init__(self, lm: torch.nn.Module, prompt_cache: SlotCache, rows_each: int, length: int) -> None:
        self.lm = lm
        self.cache = prompt_cache.grown(rows_each, length)
        device = self.cache.slots.device
        rows = self.cache.rows
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.key_valid = torch.zeros(rows, length, dtype=torch.bool, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        experts, _ = routed_experts(lm)
        self.experts_configs = list({id(m.config): m.config for m in experts}.values())
        self.experts_implementation = (decode_experts_implementation(next(experts[0].parameters()))
                                       if experts else None)

    @contextlib.contextmanager
    def _experts(self) -> Iterator[None]:
        """The step's experts implementation while it runs (the prefill and training keep the model's own)."""
        saved = [config._experts_implementation for config in self.experts_configs]
        for config in self.experts_configs:
            config._experts_implementation = self.experts_implementation
        try:
            yield
        finally:
            for config, name in zip(self.experts_configs, saved, strict=True):
                config._experts_implementation = name

    def forward(self) -> torch.Tensor:
        # a generated token is never padding: the recurrent layers take no mask in a step, as in generate
        masks = {"full_attention": self.key_valid[:, None, None, :], "linear_attention": None}
        with self._experts():
            out = self.lm(input_ids=self.tokens, attention_mask=masks, position_ids=self.positions,
                          use_cache=True, logits_to_keep=1, **{cache_kwarg(self.lm): self.cache})
        return out.logits[:, -1]

    def capture(self) -> bool:
        """Capture the step as a CUDA graph (after two warm-up runs on a side stream); False, logged, if it fails."""
        self.key_valid.fill_(True)  # warm-up and capture write slot 0 and the states of a cache not loaded yet
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.forward()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.logits = self.forward()
        except RuntimeError as exc:  # something in this model's forward cannot be captured: decode eagerly
            log.warning("decode step runs eagerly: CUDA graph capture failed (%s)", str(exc).splitlines()[0][:200])
            self.graph, self.logits = None, None
            torch.cuda.synchronize()
            return False
        self.graph = graph
        return True

    def __call__(self) -> torch.Tensor:
        if self.graph is None:
            return self.forward()
        self.graph.replay()
        return self.logits


@dataclass
class Decoded:
    tokens: torch.Tensor  # [rows, steps] sampled ids; pad after a row's EOS, as generate returns them
    logprobs: torch.Tensor  # [rows, steps] log-prob of each sampled token under the sampled distribution
    graph: bool  # whether the decode steps replayed a CUDA graph


def padded_length(width: int, max_new_tokens: int, multiple: int = 64) -> int:
    """Cache slots for a prompt width: rounded up so that prompts of nearby widths reuse one captured graph."""
    need = width + max_new_tokens
    return -(-need // multiple) * multiple


class StaticDecoder:
    """Prefill + fixed-cache decode of a transformers causal LM (or a peft model around one), graphs kept per
    (rows, cache length, weights) so that GRPO's repeated rollouts of one shape capture once. The last
    ``GRAPHS_KEPT`` steps stay allocated between calls (their KV cache: 2.25 GiB for 64 rows x 256 slots of the dense
    4B shape), and a parameter replaced by a new tensor (not updated in place) makes a new graph."""

    def __init__(self, lm: torch.nn.Module, use_graphs: bool | None = None, merge_adapters: bool = True) -> None:
        self.lm = causal_lm(lm)
        self.use_graphs = use_graphs
        self._steps: dict[tuple, DecodeStep] = {}
        self.merged = MergedAdapters(lm) if merge_adapters else None

    def _weights_key(self) -> int:
        # a graph reads parameters at the addresses it was captured with: a replaced tensor means a new graph
        return hash(tuple(p.data_ptr() for p in self.lm.parameters()))

    def _step(self, prompt_cache: SlotCache, rows_each: int, length: int) -> DecodeStep:
        rows = prompt_cache.rows * rows_each
        device = prompt_cache.slots.device
        graphs = device.type == "cuda" if self.use_graphs is None else self.use_graphs
        merged = tuple(type(m).forward is _merged_forward for m in self.merged.layers) if self.merged else ()
        key = (rows, length, device, graphs, self.lm.training, self._weights_key(), merged)
        step = self._steps.pop(key, None)
        if step is None:
            while len(self._steps) >= GRAPHS_KEPT:
                self._steps.pop(next(iter(self._steps)))
            step = DecodeStep(self.lm, prompt_cache, rows_each, length)
            if graphs:
                step.capture()
        self._steps[key] = step  # most recently used last
        return step

    @torch.no_grad()
    def decode(self, embeds: torch.Tensor, mask: torch.Tensor, n: int, max_new_tokens: int, eos_id: int,
               pad_id: int, suppress_ids: Sequence[int] = (), temperature: float = 1.0, greedy: bool = False,
               stop_check_every: int | None = None) -> Decoded:
        """Left-padded prompt embeddings [prompts, width, hidden] with their mask -> ``n`` completions per prompt
        (rows prompt-major, as ``generate(num_return_sequences=n)`` orders them).

        Sampling follows ``generate``: suppressed ids at -inf, divided by the temperature, one multinomial draw per
        row per step (finished rows too) from the fp32 softmax; greedy takes the argmax. Decoding stops once every
        row has sampled EOS (checked every ``stop_check_every`` steps: each check waits for the device; the steps
        past the stop are dropped). LoRA layers run on their merged rollout weights (``MergedAdapters``)."""
        folding = self.merged is not None and bool(self.merged.layers)
        if folding:
            self.merged.refresh()
        with self.merged.active() if folding else contextlib.nullcontext():
            return self._decode(embeds, mask, n, max_new_tokens, eos_id, pad_id, suppress_ids, temperature, greedy,
                                stop_check_every)

    def _decode(self, embeds: torch.Tensor, mask: torch.Tensor, n: int, max_new_tokens: int, eos_id: int,
                pad_id: int, suppress_ids: Sequence[int], temperature: float, greedy: bool,
                stop_check_every: int | None) -> Decoded:
        prompts, width = mask.shape
        device = embeds.device
        check_every = stop_check_every or (8 if device.type == "cuda" else 1)
        valid = mask.bool()
        positions = (mask.long().cumsum(-1) - 1).masked_fill(~valid, 1)  # generate's position ids
        order = torch.arange(width, device=device)
        allowed = (order[:, None] >= order[None, :]) & valid[:, None, :]
        allowed |= torch.eye(width, dtype=torch.bool, device=device)  # a pad query sees itself: no empty softmax
        prompt_cache = SlotCache(width, order)
        # recurrent layers zero the padding's inputs, so a left-padded prompt starts from a zero state (generate's
        # 2-D mask for them)
        masks = {"full_attention": allowed[:, None], "linear_attention": mask}
        out = self.lm(inputs_embeds=embeds, attention_mask=masks, position_ids=positions,
                      use_cache=True, logits_to_keep=1, **{cache_kwarg(self.lm): prompt_cache})
        logits = out.logits[:, -1].repeat_interleave(n, dim=0)
        del out
        length = padded_length(width, max_new_tokens)
        step = self._step(prompt_cache, n, length)
        step.cache.load(prompt_cache, n)
        del prompt_cache
        step.key_valid.zero_()
        step.key_valid[:, :width] = valid.repeat_interleave(n, dim=0)
        step.positions.copy_(positions[:, -1:].repeat_interleave(n, dim=0))
        rows = logits.shape[0]
        suppress = torch.tensor(list(suppress_ids), dtype=torch.long, device=device)
        unfinished = torch.ones(rows, dtype=torch.bool, device=device)
        finished_at = torch.full((rows,), max_new_tokens, dtype=torch.long, device=device)
        tokens, logprobs = [], []
        for t in range(max_new_tokens):
            scores = logits.float()
            if suppress.numel():
                scores.index_fill_(-1, suppress, float("-inf"))
            if greedy:
                chosen = scores.argmax(-1)
            else:
                scores = scores / temperature
                chosen = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            logprobs.append(torch.log_softmax(scores, dim=-1).gather(-1, chosen[:, None]).squeeze(-1))
            chosen = torch.where(unfinished, chosen, torch.full_like(chosen, pad_id))
            tokens.append(chosen)
            ended = unfinished & (chosen == eos_id)
            finished_at.masked_fill_(ended, t)
            unfinished &= ~ended
            if t + 1 == max_new_tokens or ((t + 1) % check_every == 0 and not bool(unfinished.any())):
                break
            step.tokens.copy_(chosen[:, None])
            step.positions.add_(1)
            step.cache.slots.fill_(width + t)
            step.key_valid[:, width + t] = True
            logits = step()
        steps = int(finished_at.max()) + 1 if not bool(unfinished.any()) else len(tokens)
        return Decoded(torch.stack(tokens[:steps], dim=1), torch.stack(logprobs[:steps], dim=1),
                       step.graph is not None)
