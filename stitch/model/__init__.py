"""stitch.model."""

from __future__ import annotations

from typing import Any


def causal_lm(lm: Any) -> Any:
    """The transformers model inside a peft wrapper (``get_base_model``), or ``lm`` itself when it has none."""
    return lm.get_base_model() if hasattr(lm, "get_base_model") else lm
