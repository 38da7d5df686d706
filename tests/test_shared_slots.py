"""prepare's shared slots: what a forked worker stacks into a slot is what the main process reads there, and a slot
is handed out again only once every tensor viewing it is gone."""

from __future__ import annotations

import gc
import multiprocessing

import pytest
import torch

from stitch.data.shared_slots import SharedSlots

fork = pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="slots reach workers by fork")


def _write(ring: SharedSlots, index: int, seed: int, queue) -> None:
    tensors = list(torch.randint(0, 256, (3, 3, 4, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    queue.put(ring.stack_into(index, tensors))


@fork
def test_a_stack_a_forked_worker_writes_into_a_slot_is_read_back_in_place_by_the_parent():
    ring = SharedSlots.for_items((3, 4, 4), torch.uint8, items_per_slot=4, count=2)  # mapped before the fork
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    ring.acquire()
    slot = ring.acquire()  # the second slot: an offset ignored would read the first, unwritten one
    child = ctx.Process(target=_write, args=(ring, slot, 7, queue))
    child.start()
    ref = queue.get(timeout=30)
    child.join(timeout=30)
    want = torch.randint(0, 256, (3, 3, 4, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    got = ring.take(ref)
    assert ref.shape == (3, 3, 4, 4) and torch.equal(got, want)
    assert not torch.equal(got, torch.zeros_like(got))  # the check can fail: an unwritten slot reads zeros


def test_a_slot_is_handed_out_again_only_when_its_last_view_is_gone():
    ring = SharedSlots.for_items((2,), torch.float32, items_per_slot=2, count=1)
    index = ring.acquire()
    ref = ring.stack_into(index, [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])])
    rows = list(ring.take(ref))  # per-row views, as prepare hands them to its rows
    assert ring.acquire() is None
    del rows[0]
    gc.collect()
    assert ring.acquire() is None and rows[0].tolist() == [3.0, 4.0]  # one view still reads the slot
    del rows
    gc.collect()
    assert ring.acquire() == index


def test_a_stack_of_mixed_shapes_or_larger_than_a_slot_does_not_fit():
    ring = SharedSlots.for_items((3, 4, 4), torch.uint8, items_per_slot=2, count=1)
    item = torch.zeros((3, 4, 4), dtype=torch.uint8)
    assert ring.fits([item, item])
    assert not ring.fits([item, item, item])
    assert not ring.fits([item, torch.zeros((3, 4, 5), dtype=torch.uint8)])
    assert not ring.fits([item, item.float()])
