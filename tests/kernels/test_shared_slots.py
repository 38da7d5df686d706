"""prepare's shared slots: what a forked worker stacks into a slot is what the main process reads there, and a slot
is handed out again only once every tensor viewing it is gone."""

from __future__ import annotations

import gc
import multiprocessing

import pytest
import torch

from stitch.kernels.shared_slots import SharedSlots, SlotBytes

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


def _put(ring: SharedSlots, index: int, payloads: list, queue) -> None:
    writer = ring.writer(index)
    queue.put(([writer.put(p) for p in payloads], writer.ref()))


@fork
def test_files_and_bytes_a_forked_worker_puts_into_a_slot_are_read_back_in_place_and_what_does_not_fit_is_refused(
        tmp_path):
    """Payloads of any size one after another in one slot, a file's read straight into it: the parent reads each
    at its ``SlotBytes``; one larger than the room left, and a file that is gone, come back as None (they travel
    their own way)."""
    first = bytes(range(256)) * 3 + b"end"  # 771 bytes: the next payload starts at the 64-byte boundary after it
    path = tmp_path / "photo.jpg"
    path.write_bytes(b"\xff\xd8" + bytes(range(100, 200)) * 5)
    ring = SharedSlots(count=2, slot_bytes=2048)
    ring.acquire()
    slot = ring.acquire()  # the second slot: an offset ignored would read the first, unwritten one
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    payloads = [first, str(path), b"x" * 2048, str(tmp_path / "gone.jpg"), b"tail"]
    child = ctx.Process(target=_put, args=(ring, slot, payloads, queue))
    child.start()
    refs, ref = queue.get(timeout=30)
    child.join(timeout=30)
    assert refs[0] == SlotBytes(0, 771) and refs[1] == SlotBytes(832, 502) and refs[2] is None and refs[3] is None
    assert refs[4] == SlotBytes(1344, 4) and ref.index == slot and ref.shape == (1348,)
    view = ring.take_bytes(ref)
    assert [bytes(view[r.offset : r.offset + r.length]) for r in (refs[0], refs[1], refs[4])] == [
        first, path.read_bytes(), b"tail"]
    payload = view[refs[1].offset : refs[1].offset + refs[1].length]  # what an item keeps: a view, not a copy
    del view
    gc.collect()
    assert ring.acquire() is None  # the item's view still reads the slot
    del payload
    gc.collect()
    assert ring.acquire() == slot


def test_a_preprocess_gets_byte_slots_only_when_it_offers_both_halves_of_the_hand_over():
    """``media_slots`` maps a byte ring for a preprocess that declares ``slot_bytes_per_item`` and offers
    ``hand_over`` and ``take_over``; with either half missing its items travel as they would without (a payload
    put into a slot that the main process cannot turn back into items would stop the run)."""
    from stitch.kernels.prepare_workers import MEDIA_CHUNK_ROWS, fork_available, media_slots

    class Both:
        stacks = False
        slot_bytes_per_item = 1024

        def hand_over(self, items, put):
            return items

        def take_over(self, items, view):
            return items

    class SendsOnly:
        stacks = False
        slot_bytes_per_item = 1024
        hand_over = Both.hand_over

    ring = media_slots(Both(), workers=2, shard_rows=64)
    if fork_available():
        assert ring is not None and ring.slot_bytes == MEDIA_CHUNK_ROWS * 1024
    assert media_slots(SendsOnly(), workers=2, shard_rows=64) is None
    assert media_slots(Both(), workers=0, shard_rows=64) is None
