"""A fixed ring of shared-memory slots that prepare's forked decode workers write a chunk's stacked media into.

Why: a tensor a worker returns through ``torch.multiprocessing`` travels as a shared-memory segment of its own:
the worker creates and maps it, the main process receives its descriptor and maps it, and freeing the chunk's rows
unmaps it with the interpreter lock held: milliseconds a chunk of the main thread, which bounds a large run. Here
one anonymous shared mapping is made before the workers fork (they inherit it): a worker writes into the slot its
task names and returns the slot's number, and the main process reads a view of the same pages. Nothing is mapped
or unmapped per chunk.

A slot is free again once every tensor viewing it is gone (a ``weakref.finalize`` on the numpy array the views are
built on), so the rows' own lifetimes decide, with no bookkeeping in the run. A chunk that finds no free slot, or
that does not fit one, travels the ``torch.multiprocessing`` way: the ring only ever saves work.

A slot can also carry payloads of any size one after another (``SlotWriter``): prepare's device path puts each
JPEG a worker checked there (its file read straight into the slot), so the main process neither opens the file
again nor unpickles its bytes; what does not fit travels as before.
"""

from __future__ import annotations

import math
import mmap
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SlotRef:
    """What a worker returns in place of a stacked tensor it wrote into slot ``index``."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class SlotBytes:
    """Where a ``SlotWriter`` put one payload in its slot: ``length`` bytes from ``offset``."""

    offset: int
    length: int


class SharedSlots:
    """``count`` slots of ``slot_bytes`` each in one anonymous ``MAP_SHARED`` mapping; make it before forking."""

    def __init__(self, count: int, slot_bytes: int) -> None:
        if count < 1 or slot_bytes < 1:
            raise ValueError(f"a slot ring needs at least one slot of one byte, got {count} x {slot_bytes}")
        self.slot_bytes = slot_bytes
        self.buffer = mmap.mmap(-1, count * slot_bytes)  # pages are committed only when first written
        self._free = list(range(count - 1, -1, -1))  # a stack: the most recently freed slot's pages are warm

    @classmethod
    def for_items(cls, item_shape: tuple[int, ...], dtype: torch.dtype, items_per_slot: int,
                  count: int) -> SharedSlots:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return cls(count, items_per_slot * math.prod(item_shape) * itemsize)

    # -- the main process ---------------------------------------------------------------------------
    def acquire(self) -> int | None:
        """A free slot's number, now reserved for one task, or None when every slot is in use."""
        return self._free.pop() if self._free else None

    def release(self, index: int) -> None:
        """Give back a slot whose task wrote nothing into it."""
        self._free.append(index)

    def take(self, ref: SlotRef) -> torch.Tensor:
        """The tensor a worker wrote into ``ref.index``, viewed in place; the slot is free again once this tensor
        and every view of it are gone."""
        nbytes = math.prod(ref.shape) * torch.empty((), dtype=ref.dtype).element_size()
        return torch.from_numpy(self._claimed(ref.index, nbytes)).view(ref.dtype).view(ref.shape)

    def take_bytes(self, ref: SlotRef) -> np.ndarray:
        """The ``ref.shape[0]`` bytes a ``SlotWriter`` filled, viewed in place as a uint8 array (slice it by each
        ``SlotBytes``); the slot is free again once this array and every view of it are gone."""
        return self._claimed(ref.index, ref.shape[0])

    def take_payloads(self, ref: SlotRef) -> Callable[[SlotBytes], np.ndarray]:
        """``take_bytes`` as the ``view`` a preprocessing's ``take_over`` calls: each ``SlotBytes`` viewed in place;
        the slot is free again once this function and every view it gave are gone."""
        payloads = self.take_bytes(ref)
        return lambda at: payloads[at.offset : at.offset + at.length]

    def _claimed(self, index: int, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of slot ``index`` as a uint8 array whose end (and its views') frees the slot."""
        array = np.frombuffer(self.buffer, dtype=np.uint8, count=nbytes, offset=index * self.slot_bytes)
        weakref.finalize(array, self._free.append, index)
        return array

    # -- a worker -----------------------------------------------------------------------------------
    def writer(self, index: int) -> SlotWriter:
        """Payloads of any size put one after another into slot ``index``."""
        return SlotWriter(self, index)

    def fits(self, tensors: list[torch.Tensor]) -> bool:
        """Whether ``tensors`` stacked fill at most one slot (same shape and dtype, bytes within a slot)."""
        first = tensors[0]
        same = all(t.shape == first.shape and t.dtype == first.dtype for t in tensors)
        return same and len(tensors) * first.numel() * first.element_size() <= self.slot_bytes

    def stack_into(self, index: int, tensors: list[torch.Tensor]) -> SlotRef:
        """``torch.stack(tensors)`` written straight into slot ``index`` (call ``fits`` first)."""
        first = tensors[0]
        shape = (len(tensors), *first.shape)
        nbytes = math.prod(shape) * first.element_size()
        flat = torch.frombuffer(self.buffer, dtype=torch.uint8, count=nbytes, offset=index * self.slot_bytes)
        torch.stack(tensors, out=flat.view(first.dtype).view(shape))
        return SlotRef(index, tuple(shape), first.dtype)


class SlotWriter:
    """A worker's payloads (bytes, or a file's whole content) put one after another into one slot, each at a
    64-byte boundary; ``ref`` is what the worker returns for the slot, None when nothing was put."""

    ALIGN = 64

    def __init__(self, ring: SharedSlots, index: int) -> None:
        self.ring, self.index, self.used = ring, index, 0

    def put(self, payload: bytes | bytearray | memoryview | str | os.PathLike) -> SlotBytes | None:
        """``payload`` (a file's path: its bytes, read straight into the slot) where it fits; None where it does not,
        or where the file cannot be read whole (the caller sends it its own way, which reports what is wrong)."""
        start = -(-self.used // self.ALIGN) * self.ALIGN
        room = self.ring.slot_bytes - start
        base = self.index * self.ring.slot_bytes + start
        if isinstance(payload, str | os.PathLike):
            try:
                with open(payload, "rb", buffering=0) as fh:
                    length = os.fstat(fh.fileno()).st_size
                    if length > room:
                        return None
                    got = 0
                    with memoryview(self.ring.buffer) as whole, whole[base : base + length] as view:
                        while got < length and (n := fh.readinto(view[got:])):
                            got += n
            except OSError:
                return None
            if got != length:  # it shrank since its size was read
                return None
        else:
            length = len(payload)
            if length > room:
                return None
            self.ring.buffer[base : base + length] = payload
        self.used = start + length
        return SlotBytes(start, length)

    def ref(self) -> SlotRef | None:
        return SlotRef(self.index, (self.used,), torch.uint8) if self.used else None
