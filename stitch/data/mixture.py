"""Weighted mixtures of partitions: which partition a stage's next row comes from, drawn from a seeded RNG of its
own (saved in every checkpoint, so a resumed run draws the same sequence), and the shares it realised."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from stitch.runs.checkpoint import random_from_json, random_to_json

T = TypeVar("T")


class Mixture:
    """Draws partition names in proportion to ``weights`` (a stage's ``mixture``); a single partition is drawn
    without touching the RNG, so a one-partition stage samples exactly as it would without a mixture."""

    def __init__(self, weights: Mapping[str, float], seed: int) -> None:
        if not weights or any(w <= 0 for w in weights.values()):
            raise ValueError(f"a mixture needs positive weights, got {dict(weights)}")
        self.names = list(weights)
        total = sum(weights.values())
        self.weights = {name: weights[name] / total for name in self.names}
        self.rng = random.Random(f"mixture-{seed}")
        self.drawn = dict.fromkeys(self.names, 0)

    def draw(self) -> str:
        name = self.names[0] if len(self.names) == 1 else self.rng.choices(
            self.names, weights=[self.weights[n] for n in self.names])[0]
        self.drawn[name] += 1
        return name

    def pick(self, pools: Mapping[str, Sequence[T]], rng: random.Random) -> T:
        """One item of the next drawn partition's pool, chosen by ``rng`` (the stage's own)."""
        pool = pools[self.draw()]
        return pool[rng.randrange(len(pool))]

    def state_dict(self) -> dict[str, Any]:
        return {"rng": random_to_json(self.rng), "drawn": dict(self.drawn)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if set(state["drawn"]) != set(self.names):
            raise ValueError(f"cannot resume: the checkpoint's data mixture draws from {sorted(state['drawn'])} but "
                             f"this run's from {sorted(self.names)}")
        random_from_json(self.rng, state["rng"])
        self.drawn = dict(state["drawn"])

    def report(self) -> dict[str, dict[str, float | int]]:
        """Per partition: its weight (normalised), the rows drawn from it and the share those realise."""
        total = sum(self.drawn.values())
        return {name: {"weight": round(self.weights[name], 4), "drawn": self.drawn[name],
                       "share": round(self.drawn[name] / total, 4) if total else 0.0} for name in self.names}
