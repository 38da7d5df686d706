"""Rollout engines: generation from prompt embeddings (projected soft tokens already spliced in).

Callers build those embeddings with ``stitch.rollout.prompts.prompt_embeddings``, through the rollout payload the
encoder names (built and validated there), so no engine sees raw media, cached features or the encoder.

The embedded engine decodes on the policy itself, so a refit is a no-op: on a fixed-size cache (KV and recurrent
states) with each decode step replayed as a CUDA graph (``stitch.rollout.decode``) where the model's layers allow it,
else with transformers ``generate(inputs_embeds=...)``. Engines that hold their own weights (vLLM) receive merged weights through ``refit``.

Every engine's ``generate(prompt_embeds, n, max_new_tokens, temperature=1.0, greedy=False, seed=None)`` samples
from ``seed`` alone when given one (GRPO passes ``sampling_seed(run seed, step)``), so a step's rollouts are the
same whatever ran before it: after a resume, and in processes (Ray workers, a vLLM engine) whose RNG no
checkpoint holds. ``seed=None`` draws from the process's RNG.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stitch.rollout.decode import StaticDecoder, static_decode_unsupported

log = logging.getLogger("stitch")


def sampling_seed(*parts: object) -> int:
    """A 62-bit seed derived from ``parts`` (run seed, step, replica rank, prompt index): independent streams for
    distinct parts, the same seed for the same parts in any process."""
    digest = hashlib.sha256("\0".join(map(repr, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


@contextlib.contextmanager
def seeded_rng(seed: int | None, device: torch.device) -> Iterator[None]:
    """Inside: the CPU generator and ``device``'s CUDA generator seeded from ``seed``; after: both as they were
    (the trainer's RNG stream, which its checkpoints hold, is not disturbed). ``None``: the process's RNG as is."""
    if seed is None:
        yield
        return
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        torch.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)  # this device's generator only
        yield


@dataclass
class Completion:
    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]  # the engine's log-prob of each sampled token (temperature applied)


def mask_suppressed(logits: torch.Tensor, suppress_ids: Sequence[int]) -> torch.Tensor:
    """Logits with the suppressed ids at -inf: the distribution every engine samples from and scores."""
    if not suppress_ids:
        return logits
    logits = logits.clone()
    logits[..., list(suppress_ids)] = float("-inf")
    return logits


def left_pad(prompt_embeds: list[torch.Tensor], pad_embed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(e.shape[0] for e in prompt_embeds)
    batch = pad_embed.expand(len(prompt_embeds), width, pad_embed.shape[-1]).clone()
    mask = torch.zeros(len(prompt_embeds), width, dtype=torch.long, device=pad_embed.device)
    for i, emb in enumerate(prompt_embeds):
        batch[i, width - emb.shape[0] :] = emb
        mask[i, width - emb.shape[0] :] = 1
    return batch, mask


class EmbeddedEngine:
    """Generation on the live policy LM: stitch's fixed-cache decoder where the model qualifies (attention, Gated
    DeltaNet, Mamba-2 and MoE layers; same tokens and log-probs as ``generate``, CUDA graphs on a GPU), transformers
    ``generate`` otherwise or with ``static_decode=False``; the choice is logged when the engine is built."""

    name = "embedded"

    def __init__(self, lm: Any, pad_id: int, eos_id: int, suppress_ids: Sequence[int] = (),
                 static_decode: bool = True) -> None:
        self.lm = lm
        self.pad_id = pad_id
        self.eos_id = eos_id
        # media sentinels must never be sampled: a completion holding a placeholder would break the scatter
        self.suppress_ids = list(suppress_ids)
        why_not = static_decode_unsupported(lm) if static_decode else "static_decode=False"
        self.decoder = StaticDecoder(lm) if why_not is None else None
        self.decode_path = "fixed-cache decode" if why_not is None else f"transformers generate ({why_not})"
        log.info("embedded rollout engine: %s", self.decode_path)

    def refit(self, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Nothing to do: the engine generates with the policy's own (adapter-carrying) weights."""

    @torch.no_grad()
    def generate(self, prompt_embeds: list[torch.Tensor], n: int, max_new_tokens: int,
                 temperature: float = 1.0, greedy: bool = False, seed: int | None = None) -> list[Completion]:
        with seeded_rng(seed, prompt_embeds[0].device):
            return self._generate(prompt_embeds, n, max_new_tokens, temperature, greedy)

    def _generate(self, prompt_embeds: list[torch.Tensor], n: int, max_new_tokens: int, temperature: float,
                  greedy: bool) -> list[Completion]:
        pad = self.lm.get_input_embeddings()(torch.tensor([self.pad_id], device=prompt_embeds[0].device))[0]
        embeds, mask = left_pad(prompt_embeds, pad)
        if self.decoder is not None:
            decoded = self.decoder.decode(embeds, mask, n, max_new_tokens, self.eos_id, self.pad_id, self.suppress_ids,
                                          temperature=temperature, greedy=greedy)
            return self._completions(decoded.tokens, decoded.logprobs, n)
        out = self.lm.generate(
            inputs_embeds=embeds,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=not greedy,
            temperature=temperature if not greedy else None,
            top_k=0 if not greedy else None,
            top_p=1.0 if not greedy else None,
            num_return_sequences=n,
            suppress_tokens=self.suppress_ids or None,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        sequences = out.sequences[:, -len(out.logits):]
        scale = 1.0 if greedy else temperature
        # one step at a time: stacking [B*n, T, vocab] in fp32 (and its softmax copies) costs GiBs at 4B scale
        logprobs = torch.stack([
            torch.log_softmax(mask_suppressed(step.float(), self.suppress_ids) / scale, dim=-1)
            .gather(-1, sequences[:, t, None]).squeeze(-1)
            for t, step in enumerate(out.logits)
        ], dim=1)
        del out
        return self._completions(sequences, logprobs, n)

    def _completions(self, sequences: torch.Tensor, logprobs: torch.Tensor, n: int) -> list[Completion]:
        """Rows [prompts * n, steps] cut after their first EOS."""
        completions = []
        for i in range(sequences.shape[0]):
            ids, lps = [], []
            for tok, lp in zip(sequences[i].tolist(), logprobs[i].tolist(), strict=True):
                ids.append(tok)
                lps.append(lp)
                if tok == self.eos_id:
                    break
            completions.append(Completion(i // n, ids, lps))
        return completions
