"""Step-level batching for `stitch serve`: one thread prefills all waiting requests' choices together, then runs one
LM forward per step for every row, each sampled with its own temperature, top-p and generator (a request's ``seed``
makes its answer independent of its batch mates); new text reaches each request through ``emit`` as it decodes."""

from __future__ import annotations

import collections
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from stitch.kernels.attention import cache_kwarg
from stitch.rollout.engines import left_pad, sampling_seed


@dataclass(frozen=True)
class Sampling:
    """One request's sampling: temperature 0 is greedy (the engine's argmax, as ``stitch infer`` decodes)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass
class Choice:
    """One sampled sequence: its tokens, the text sent so far and why it ended."""

    index: int
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0
    finish_reason: str | None = None


Emit = Callable[[int, str, str | None], None]  # (choice index, new text, finish reason or None)


@dataclass
class Job:
    """A request in the batcher: its prompt embeddings ``[prompt_len, hidden]``, sampling and where text goes."""

    embeds: torch.Tensor
    sampling: Sampling
    emit: Emit
    choices: list[Choice] = field(default_factory=list)
    cancelled: bool = False

    def __post_init__(self) -> None:
        base = self.sampling.seed if self.sampling.seed is not None else random.getrandbits(62)
        for i in range(self.sampling.n):
            generator = torch.Generator(device=self.embeds.device)
            generator.manual_seed(sampling_seed(base, i))
            self.choices.append(Choice(i, generator))


def sample_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """One token from fp32 ``logits [vocab]`` (suppressed ids already at -inf): argmax at temperature 0, else the
    temperature-scaled softmax cut to its top-p nucleus."""
    if sampling.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= sampling.top_p  # the top token always stays
        probs = probs.scatter(0, order, sorted_probs.masked_fill(outside, 0.0))
    return int(torch.multinomial(probs, 1, generator=generator))


class TextTracker:
    """A choice's text as tokens arrive: cut at the first stop string, and only what no later token can change is
    sent (a stop string's possible prefix and an unfinished UTF-8 character are held back)."""

    def __init__(self, tokenizer: Any, stop: Sequence[str]) -> None:
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        self.hold = max((len(s) - 1 for s in self.stop), default=0)

    def update(self, choice: Choice) -> tuple[str, bool]:
        """(text to send now, whether a stop string ended the choice)."""
        text = self.tokenizer.decode(choice.tokens, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            choice.text = text[: min(hits)]
            return self.flush(choice), True
        choice.text = text
        safe = len(text) - self.hold
        while safe > choice.sent and text[safe - 1] == "\ufffd":
            safe -= 1
        return self._take(choice, safe), False

    def flush(self, choice: Choice) -> str:
        return self._take(choice, len(choice.text))

    @staticmethod
    def _take(choice: Choice, upto: int) -> str:
        piece = choice.text[choice.sent : upto] if upto > choice.sent else ""
        choice.sent = max(choice.sent, upto)
        return piece


class Batcher:
    """Decodes jobs in batches on ``lm`` in a thread of its own; ``submit`` is thread-safe."""

    def __init__(self, lm: Any, tokenizer: Any, eos_id: int, pad_id: int, suppress_ids: Sequence[int],
                 max_rows: int = 32, wait_s: float = 0.0) -> None:
        self.lm, self.tokenizer = lm, tokenizer
        self.eos_id, self.pad_id, self.max_rows = eos_id, pad_id, max_rows
        self.wait_s = wait_s  # how long a batch's first request waits for others to join it
        self.suppress = torch.tensor(list(suppress_ids), dtype=torch.long)
        self.waiting: queue.Queue[Job] = queue.Queue()
        self.batch_count = 0
        self.recent_rows: collections.deque[int] = collections.deque(maxlen=64)  # rows of the last batches
        self._thread = threading.Thread(target=self._loop, name="stitch-serve-batcher", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self.waiting.put(job)

    def _loop(self) -> None:
        while True:
            jobs = [self.waiting.get()]
            rows = len(jobs[0].choices)
            deadline = time.monotonic() + self.wait_s
            while rows < self.max_rows:
                try:
                    job = self.waiting.get(timeout=max(deadline - time.monotonic(), 0))  # 0: what is queued now
                except queue.Empty:
                    break
                jobs.append(job)
                rows += len(job.choices)
            try:
                self.decode(jobs)
            except Exception as exc:  # noqa: BLE001 - a failed batch fails its requests, not the server
                for job in jobs:
                    for choice in job.choices:
                        if choice.finish_reason is None:
                            job.emit(choice.index, "", f"error: {type(exc).__name__}: {exc}")

    @torch.no_grad()
    def decode(self, jobs: list[Job]) -> None:
        """Prefill all rows at once, then one forward per step until every row has ended."""
        rows = [(job, choice) for job in jobs for choice in job.choices]
        self.batch_count += 1
        self.recent_rows.append(len(rows))
        trackers = {id(job): TextTracker(self.tokenizer, job.sampling.stop) for job in jobs}
        device = jobs[0].embeds.device
        pad = self.lm.get_input_embeddings()(torch.tensor([self.pad_id], device=device))[0]
        embeds, mask = left_pad([job.embeds for job, _ in rows], pad)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.lm(inputs_embeds=embeds, attention_mask=mask, position_ids=positions, use_cache=True,
                      logits_to_keep=1)
        position = positions[:, -1:]
        for _ in range(max(job.sampling.max_tokens for job in jobs)):
            logits = out.logits[:, -1].float()
            if self.suppress.numel():
                logits.index_fill_(-1, self.suppress.to(logits.device), float("-inf"))
            chosen = [self._advance(job, choice, logits[i], trackers[id(job)]) for i, (job, choice)
                      in enumerate(rows)]
            if all(choice.finish_reason is not None for _, choice in rows):
                return
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            position = position + 1
            out = self.lm(input_ids=torch.tensor(chosen, device=device)[:, None], attention_mask=mask,
                          position_ids=position, use_cache=True, **{cache_kwarg(self.lm): out.past_key_values})

    def _advance(self, job: Job, choice: Choice, logits: torch.Tensor, tracker: TextTracker) -> int:
        """Sample ``choice``'s next token, send its new text; the token to feed next (pad once it has ended)."""
        if choice.finish_reason is not None:
            return self.pad_id
        if job.cancelled:
            choice.finish_reason = "cancelled"
            return self.pad_id
        token = sample_token(logits, job.sampling, choice.generator)
        if token == self.eos_id:
            choice.finish_reason = "stop"
            job.emit(choice.index, tracker.flush(choice), "stop")
            return self.pad_id
        choice.tokens.append(token)
        piece, stopped = tracker.update(choice)
        if stopped or len(choice.tokens) >= job.sampling.max_tokens:
            choice.finish_reason = "stop" if stopped else "length"
            job.emit(choice.index, piece + tracker.flush(choice), choice.finish_reason)
        elif piece:
            job.emit(choice.index, piece, None)
        return token
