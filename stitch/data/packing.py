"""Token-budget packing: online next-fit over a bounded shuffle buffer that reads the manifest lazily.

The stream's state (byte offset in the manifest, epoch, RNG, buffer of raw rows, the pending sample that
did not fit the last pack) is JSON, saved in every checkpoint, so a resumed run draws the same packs.
Samples are tokenized and their features loaded only when drawn. A mixture of partitions keeps one such
reader (offset, epoch, buffer) per partition and draws which one gives the next row (``Mixture``).
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from stitch.data.mixture import Mixture
from stitch.runs.checkpoint import random_from_json, random_to_json


@dataclass
class Sample:
    row_id: str
    input_ids: list[int]
    labels: list[int]
    features: torch.Tensor  # [items, tokens, width]

    def __len__(self) -> int:
        return len(self.input_ids)


class _ManifestReader:
    """The manifest rows ``accept`` takes, read lazily into a bounded buffer, wrapping around at the end (an
    epoch); its position (byte offset, epoch, buffer) is JSON."""

    def __init__(self, manifest: Path, accept: Callable[[dict[str, Any]], bool], buffer_size: int,
                 what: str) -> None:
        self.manifest, self.accept, self.buffer_size = manifest, accept, buffer_size
        self.offset = 0
        self.epoch = 0
        self.buffer: list[dict[str, Any]] = []
        with self.manifest.open("rb") as fh:
            if not any(self.accept(json.loads(line)) for line in fh if line.strip()):
                raise ValueError(f"{self.manifest}: no manifest rows match {what}")

    def state_dict(self) -> dict[str, Any]:
        return {"offset": self.offset, "epoch": self.epoch, "buffer": list(self.buffer)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.offset = state["offset"]
        self.epoch = state["epoch"]
        self.buffer = list(state["buffer"])

    def fill(self) -> None:
        with self.manifest.open("rb") as fh:
            fh.seek(self.offset)
            while len(self.buffer) < self.buffer_size:
                line = fh.readline()
                if not line:  # end of an epoch: wrap around
                    self.epoch += 1
                    fh.seek(0)
                    self.offset = 0
                    continue
                self.offset = fh.tell()
                if line.strip():
                    row = json.loads(line)
                    if self.accept(row):
                        self.buffer.append(row)


class PackedStream:
    """Yields packs (lists of Samples) whose total length is at most ``token_budget``.

    With ``pack=False`` every pack holds exactly one sample (for models whose layers would leak state
    across packed samples). ``rows`` filters manifest rows (e.g. by partition); ``mixture`` instead draws each row
    from one of several partitions in proportion to its weight (``{partition: weight}``; one partition reads as
    ``rows`` does).
    """

    def __init__(
        self,
        manifest: Path,
        make_sample: Callable[[dict[str, Any]], Sample],
        *,
        token_budget: int,
        buffer_size: int = 64,
        seed: int = 0,
        pack: bool = True,
        rows: Callable[[dict[str, Any]], bool] = lambda row: True,
        mixture: dict[str, float] | None = None,
    ) -> None:
        self.manifest = Path(manifest)
        self.make_sample = make_sample
        self.token_budget = token_budget
        self.buffer_size = buffer_size
        self.pack = pack
        self.rng = random.Random(seed)
        self.pending: dict[str, Any] | None = None
        self.mixture = Mixture(mixture, seed) if mixture else None
        if self.mixture is None:
            self.readers = {"": _ManifestReader(self.manifest, rows, buffer_size, "this stage's partition")}
        else:
            self.readers = {name: _ManifestReader(self.manifest, functools.partial(_in_partition, name), buffer_size,
                                                  f"partition {name!r} of this stage's data")
                            for name in self.mixture.names}

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = {
            "rng": random_to_json(self.rng),
            "pending": self.pending,
            "pack": self.pack,
            "token_budget": self.token_budget,
        }
        if len(self.readers) == 1:  # one partition: its reader's position at the top, as a stream without a mixture
            state.update(next(iter(self.readers.values())).state_dict())
        else:
            state["readers"] = {name: reader.state_dict() for name, reader in self.readers.items()}
        if self.mixture is not None:
            state["mixture"] = self.mixture.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # packing can depend on the machine (Nemotron-H packs only where fla's kernels run): a resume that would
        # batch differently from the run it continues is refused rather than silently diverging
        for key, now in (("pack", self.pack), ("token_budget", self.token_budget)):
            if key in state and state[key] != now:
                hint = (" (packing follows the model binding on this machine: see `stitch models --json` and the "
                        "binding's packing_note)") if key == "pack" else ""
                raise ValueError(f"cannot resume: the checkpoint's data stream has {key}={state[key]!r} but this "
                                 f"run has {key}={now!r}{hint}")
        if self.mixture is not None and "mixture" in state:
            self.mixture.load_state_dict(state["mixture"])
        elif self.mixture is not None and len(self.readers) > 1:
            raise ValueError("cannot resume: the checkpoint's data stream has no mixture state but this run draws "
                             f"from {sorted(self.readers)}")
        if len(self.readers) == 1:
            next(iter(self.readers.values())).load_state_dict(state)
        else:
            if set(state.get("readers", ())) != set(self.readers):
                raise ValueError(f"cannot resume: the checkpoint's data stream reads {sorted(state.get('readers', ()))}"
                                 f" but this run reads {sorted(self.readers)}")
            for name, reader in self.readers.items():
                reader.load_state_dict(state["readers"][name])
        random_from_json(self.rng, state["rng"])
        self.pending = state["pending"]

    @property
    def epoch(self) -> int:
        """Completed passes over the (first) partition read."""
        return next(iter(self.readers.values())).epoch

    # -- drawing -----------------------------------------------------------------------------------
    def _draw_row(self) -> dict[str, Any]:
        if self.pending is not None:
            row, self.pending = self.pending, None
            return row
        reader = self.readers[self.mixture.draw()] if self.mixture is not None else self.readers[""]
        reader.fill()
        return reader.buffer.pop(self.rng.randrange(len(reader.buffer)))

    def next_pack(self) -> list[Sample]:
        pack: list[Sample] = []
        used = 0
        while True:
            row = self._draw_row()
            sample = self.make_sample(row)
            if len(sample) > self.token_budget:
                raise ValueError(
                    f"row {sample.row_id}: {len(sample)} tokens exceed the token budget {self.token_budget}; "
                    f"raise the stage's token_budget"
                )
            if pack and used + len(sample) > self.token_budget:
                self.pending = row  # next-fit: close this pack, the row opens the next one
                return pack
            pack.append(sample)
            used += len(sample)
            if not self.pack:
                return pack

    def __iter__(self) -> Iterator[list[Sample]]:
        while True:
            yield self.next_pack()


def _in_partition(name: str, row: dict[str, Any]) -> bool:
    return row["partition"] == name


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; from the host to a GPU through pinned memory without blocking the host, which a
    copy from pageable memory does (it synchronises)."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [rows, length]
    labels: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None  # None for packed rows: the model builds a block-causal mask
    features: torch.Tensor  # [items, tokens, width], in placeholder order across the batch
    row_ids: list[str]
    tokens: int  # real (non-padding) tokens
    # the batch as collated, on the host, kept by ``to``: the model reads sample starts, label and placeholder
    # positions from it, so the step never asks the device for them (each ask is a sync that idles the GPU)
    host: Batch | None = field(default=None, repr=False, compare=False)

    def to(self, device: torch.device | str) -> Batch:
        """The batch on ``device``. To a GPU the tensors go through pinned memory without blocking the host, which
        a copy from pageable memory does (it synchronises); the host batch stays reachable as ``host``."""
        device = torch.device(device)

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else to_device(t, device)

        on_host = self.input_ids.device.type == "cpu"
        return Batch(
            move(self.input_ids), move(self.labels), move(self.position_ids), move(self.attention_mask),
            move(self.features), self.row_ids, self.tokens, host=self if on_host else self.host,
        )


def collate_packs(packs: list[list[Sample]], pad_id: int, packed: bool, length: int | None = None) -> Batch:
    """Concatenate each pack into one row (position ids reset per sample) and pad rows to one length.

    Packed rows get no attention mask: transformers derives a block-causal mask from the position-id
    resets, so no token attends across a sample boundary. Unpacked rows (one sample each) are right-padded
    with an attention mask.
    """
    rows_ids, rows_labels, rows_pos = [], [], []
    features: list[torch.Tensor] = []
    row_ids: list[str] = []
    for pack in packs:
        ids, labels, pos = [], [], []
        for sample in pack:
            ids += sample.input_ids
            labels += sample.labels
            pos += list(range(len(sample)))
            features.append(sample.features)
            row_ids.append(sample.row_id)
        rows_ids.append(ids)
        rows_labels.append(labels)
        rows_pos.append(pos)
    width = length or max(len(r) for r in rows_ids)
    real = sum(len(r) for r in rows_ids)
    input_ids = torch.full((len(packs), width), pad_id, dtype=torch.long)
    labels_t = torch.full((len(packs), width), -100, dtype=torch.long)
    position_ids = torch.zeros((len(packs), width), dtype=torch.long)
    attention = torch.zeros((len(packs), width), dtype=torch.long)
    for i, (ids, labels, pos) in enumerate(zip(rows_ids, rows_labels, rows_pos, strict=True)):
        n = len(ids)
        input_ids[i, :n] = torch.tensor(ids)
        labels_t[i, :n] = torch.tensor(labels)
        position_ids[i, :n] = torch.tensor(pos)
        # padding continues as its own short "sample" so it never joins a real one
        position_ids[i, n:] = torch.arange(width - n)
        attention[i, :n] = 1
    return Batch(
        input_ids=input_ids,
        labels=labels_t,
        position_ids=position_ids,
        attention_mask=None if packed else attention,
        features=torch.cat(features) if features else torch.empty(0),
        row_ids=row_ids,
        tokens=real,
    )
