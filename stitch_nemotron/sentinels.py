"""The Nemotron-H sentinel set: three reserved ``<SPECIAL_N>`` slots of the real tokenizer."""

from __future__ import annotations

from stitch.api import SentinelSpec

# The Nemotron-family tokenizer (131,072 entries) keeps <SPECIAL_N> control slots; ids 10-13 carry the ChatML and
# think markers, and <SPECIAL_22>..<SPECIAL_999> are reserved and absent from the chat template (a public probe of a
# family tokenizer, docs/models.md). stitch takes three from the middle of that block. Not read from the pinned
# revisions (no hub access): resolve_sentinels refuses them loudly, naming the token, if a real tokenizer splits one.
SENTINELS = SentinelSpec(
    name="nemotron-h",
    start="<SPECIAL_100>",
    placeholder="<SPECIAL_101>",
    end="<SPECIAL_102>",
    video_start="<SPECIAL_103>",  # a clip's own brackets, from the same reserved block
    video_end="<SPECIAL_104>",
    description="Reserved, unused <SPECIAL_N> control tokens of the Nemotron-H tokenizer; the tiny presets' "
    "tokenizers hold the same strings as special tokens.",
)
