"""stitch's own calls into transformers and peft raise none of their deprecation warnings."""

from __future__ import annotations

import warnings

from stitch.kernels.attention import cache_kwarg
from stitch.model.binding import _quiet_peft_wrap


class NewForward:
    def forward(self, input_ids=None, cache=None, use_cache=None):  # transformers that renamed the keyword
        return None


class OldForward:
    def forward(self, input_ids=None, past_key_values=None, use_cache=None):
        return None


def test_the_cache_goes_by_the_keyword_the_models_forward_takes():
    assert cache_kwarg(NewForward()) == "cache"
    assert cache_kwarg(OldForward()) == "past_key_values"


def test_wrapping_with_peft_hides_only_its_is_gradient_checkpointing_deprecation():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _quiet_peft_wrap():
            warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning, stacklevel=1)
            warnings.warn("something else", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["something else"]
