"""Resolving sentinel strings to token ids, refusing any that is not exactly one token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stitch.plugins.specs import IMAGE_MARKER, SentinelSpec


@dataclass(frozen=True)
class SentinelIds:
    start: int
    placeholder: int
    end: int
    marker: str = IMAGE_MARKER  # the text marker an item of this layout stands at (``<image>``, ``<video>``)

    def as_dict(self) -> dict[str, int]:
        return {"start": self.start, "placeholder": self.placeholder, "end": self.end}


class SentinelError(ValueError):
    pass


def resolve_sentinels(spec: SentinelSpec, tokenizer: Any) -> SentinelIds:
    """Token ids of ``spec``'s start/placeholder/end in ``tokenizer``; each must encode to one token."""
    where = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    ids = []
    for role, token in zip(("start", "placeholder", "end"), spec.tokens, strict=True):
        encoded = tokenizer.encode(token, add_special_tokens=False)
        if len(encoded) != 1:
            pieces = tokenizer.convert_ids_to_tokens(encoded)
            raise SentinelError(
                f"sentinel {role} token {token!r} (set {spec.name!r}) is {len(encoded)} tokens {pieces} in "
                f"tokenizer {where!r}; it must be exactly one token. Pick a token the tokenizer already "
                f"has as a single special token, or add it with tokenizer.add_special_tokens()."
            )
        ids.append(encoded[0])
    if len(set(ids)) != 3:
        raise SentinelError(f"sentinels of set {spec.name!r} are not distinct in tokenizer {where!r}: {ids}")
    return SentinelIds(*ids, marker=spec.marker)
