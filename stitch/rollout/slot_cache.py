"""The fixed-size decode cache: attention keys/values at slots and the recurrent layers' conv + recurrent states
(Gated DeltaNet, Mamba-2), one row per sequence, in buffers allocated once and written in place, duck-typing the part
of transformers' ``Cache`` that those layers call."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class RecurrentSlots:
    """One recurrent layer's states where transformers' linear-attention layers read them
    (``cache.layers[i].conv_states[0]``, ``.recurrent_states[0]``): [rows, ...] buffers updated in place."""

    # past conv windows are never kept for a rollback: a single-token step takes the layers' in-place update path
    record_past = False

    def __init__(self) -> None:
        self.conv_states: dict[int, torch.Tensor | None] = {0: None}
        self.recurrent_states: dict[int, torch.Tensor | None] = {0: None}

    def buffers(self) -> dict[str, torch.Tensor]:
        """The allocated buffers by kind (``conv``, ``recurrent``)."""
        kinds = {"conv": self.conv_states[0], "recurrent": self.recurrent_states[0]}
        return {kind: buf for kind, buf in kinds.items() if buf is not None}

    def set(self, kind: str, buf: torch.Tensor) -> None:
        (self.conv_states if kind == "conv" else self.recurrent_states)[0] = buf


class SlotCache:
    """Keys and values of every attention layer in fixed [rows, kv_heads, length, head_dim] buffers, and every
    recurrent layer's states in fixed [rows, ...] buffers (``RecurrentSlots``).

    ``update`` writes the new keys at the slots held in ``slots`` (a device tensor, so a captured graph replays at
    new slots) and returns the whole buffer. A prompt cache (``prefilled=False``) takes one prefill forward as
    transformers' own cache does: the conv window's last taps and the final recurrent state are stored. ``grown``
    makes the decode cache (``prefilled=True``), on which the layers read and update their states in place (conv
    window shift and recurrent step), so a decode step has fixed addresses and shapes and can be captured."""

    def __init__(self, length: int, slots: torch.Tensor, prefilled: bool = False) -> None:
        self.length = length
        self.slots = slots
        self.prefilled = prefilled
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []
        self.layers: dict[int, RecurrentSlots] = {}  # recurrent layers only, by layer index

    @property
    def rows(self) -> int:
        for buf in (*self.keys, *(b for layer in self.layers.values() for b in layer.buffers().values())):
            if buf is not None:
                return buf.shape[0]
        raise ValueError("the cache holds no layer yet: the prompt's prefill writes its first entries")

    # -- attention layers ------------------------------------------------------------------------------------------

    def _allocate(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        while len(self.keys) <= layer:
            self.keys.append(None)
            self.values.append(None)
        rows, heads = key.shape[:2]
        self.keys[layer] = key.new_zeros(rows, heads, self.length, key.shape[-1])
        self.values[layer] = value.new_zeros(rows, value.shape[1], self.length, value.shape[-1])

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx >= len(self.keys) or self.keys[layer_idx] is None:
            self._allocate(layer_idx, key, value)
        self.keys[layer_idx].index_copy_(2, self.slots, key)
        self.values[layer_idx].index_copy_(2, self.slots, value)
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    # -- recurrent layers (transformers' LinearAttentionLayer interface) --------------------------------------------

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self.prefilled

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The layer's conv window once prefilled (None before: the prefill starts from zeros)."""
        return self._state(layer_idx, state_idx, "conv")

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The layer's recurrent state once prefilled (None before: the prefill starts from zeros)."""
        return self._state(layer_idx, state_idx, "recurrent")

    def is_recording_past(self, layer_idx: int) -> bool:
        return RecurrentSlots.record_past

    def _state(self, layer_idx: int, state_idx: int, kind: str) -> torch.Tensor | None:
        layer = self.layers.get(layer_idx)
        if not self.prefilled or layer is None:
            return None
        return (layer.conv_states if kind == "conv" else layer.recurrent_states).get(state_idx)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs: Any) -> torch.Tensor:
        """The prefill's conv input [rows, channels, tokens]: its last ``conv_kernel_size`` tokens (zeros before a
        shorter prompt) become the conv window; returned as transformers returns it (left-padded to the window)."""
        if self.prefilled or state_idx != 0:
            raise RuntimeError(f"layer {layer_idx}: the fixed-size cache takes one prefill and then single-token "
                               f"steps (conv states of {conv_states.shape[-1]} tokens after the prefill, state "
                               f"{state_idx}); transformers' own cache handles the other cases")
        window = conv_states.shape[-1] if conv_kernel_size is None else conv_kernel_size
        if conv_states.shape[-1] < window:
            conv_states = F.pad(conv_states, (window - conv_states.shape[-1], 0), value=0)
        layer = self.layers.setdefault(layer_idx, RecurrentSlots())
        layer.conv_states[0] = conv_states[..., -window:].clone()
        return conv_states

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs: Any) -> torch.Tensor:
        """Copy a layer's new recurrent state into its buffer (allocated at the prefill) and return the buffer."""
        layer = self.layers.setdefault(layer_idx, RecurrentSlots())
        buffer = layer.recurrent_states[state_idx]
        if buffer is None:
            buffer = layer.recurrent_states[state_idx] = torch.zeros_like(recurrent_states)
        buffer.copy_(recurrent_states)
        return buffer

    # -- prompt cache -> decode cache --------------------------------------------------------------------------------

    def grown(self, rows_each: int, length: int) -> SlotCache:
        """A prefilled ``length``-slot cache shaped for this one's rows each repeated ``rows_each`` times (zeros;
        ``load`` fills it)."""
        out = SlotCache(length, torch.zeros(1, dtype=torch.long, device=self.slots.device), prefilled=True)
        for mine, theirs in ((self.keys, out.keys), (self.values, out.values)):
            for buf in mine:
                theirs.append(None if buf is None else
                              buf.new_zeros(buf.shape[0] * rows_each, buf.shape[1], length, buf.shape[-1]))
        for index, layer in self.layers.items():
            grown = out.layers[index] = RecurrentSlots()
            for kind, buf in layer.buffers().items():
                grown.set(kind, buf.new_zeros(buf.shape[0] * rows_each, *buf.shape[1:]))
        return out

    def load(self, prompt: SlotCache, rows_each: int) -> None:
        """Overwrite with ``prompt``'s entries and states, each row repeated ``rows_each`` times (every sample of a
        prompt starts from that prompt's state); later slots are zeroed."""
        width = prompt.length
        for mine, theirs in ((self.keys, prompt.keys), (self.values, prompt.values)):
            for buf, src in zip(mine, theirs, strict=True):
                if buf is not None:
                    buf[:, :, :width].copy_(src.repeat_interleave(rows_each, dim=0))
                    buf[:, :, width:].zero_()
        if self.layers.keys() != prompt.layers.keys():
            raise ValueError(f"recurrent layers {sorted(prompt.layers)} in the prompt cache, {sorted(self.layers)} "
                             f"in the decode cache")
        for index, layer in self.layers.items():
            sources = prompt.layers[index].buffers()
            for kind, buf in layer.buffers().items():
                buf.copy_(sources[kind].repeat_interleave(rows_each, dim=0))
