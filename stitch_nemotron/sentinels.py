"""The Nemotron-H sentinel set: three reserved ``<SPECIAL_N>`` slots of the real tokenizer."""

from __future__ import annotations

from stitch.api import SentinelSpec

# The Nemotron-H tokenizer (131,072 entries, Tekken-derived) reserves its first 1,000 ids as <SPECIAL_N> control
# tokens, each a single token. Releases have renamed low slots for chat, think and tool markers (e.g.
# <SPECIAL_10>-<SPECIAL_12> framed Nano v2 chat turns), so stitch takes three from the middle of the block.
# Chosen from knowledge of the vocabulary, not read from the pinned revisions (no hub access here):
# resolve_sentinels refuses them loudly, naming the token, if a real tokenizer splits one.
SENTINELS = SentinelSpec(
    name="nemotron-h",
    start="<SPECIAL_100>",
    placeholder="<SPECIAL_101>",
    end="<SPECIAL_102>",
    description="Reserved, unused <SPECIAL_N> control tokens of the Nemotron-H tokenizer; the tiny presets' "
    "tokenizers hold the same strings as special tokens.",
)
