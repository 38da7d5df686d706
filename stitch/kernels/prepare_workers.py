"""How preparation is made fast: decode worker processes and their shared slots, the encode and shard-writer
threads, GC freezing, one-thread host copies and phase clocks. The row semantics stay in ``stitch.data.prepare``;
they cross this seam as callables and values (this module imports nothing of ``stitch.data``)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import itertools
import multiprocessing
import signal
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

import torch
import torch.multiprocessing as mp  # its pickler hands tensors over in shared memory

from stitch.kernels.shared_slots import SharedSlots, SlotBytes, SlotRef

# threads writing shard files: a shard's write overlaps the previous one's, which a new file's page allocation
# bounds; rows still reach the manifest in order
SHARD_WRITERS = 2


ENCODE_PHASES = {
    "encoder_load": "waiting for the encoder to load (it loads in a thread from the start of a fresh run) and, "
                    "when it compiles, compiling it",
    "inputs": "making each encoder call's input: stacking a batch's items, or the preprocessing's device_batch "
              "(CLIP's: nvjpeg decode and resize on the GPU)",
    "encode": "the encoder (host to device, the tower), features back to the host",
}


class PhaseClock:
    """Where the main process spends a run's wall time: ``with clock(phase)`` adds the time inside to ``phase``;
    a phase entered inside another pauses the outer one, so the phases never count a second twice."""

    PHASES = {
        "tokenizer_load": "setting up the prompt check with the caller's tokenizer",
        "workers_start": "starting the decode worker processes",
        "stream_open": "opening the dataset stream (datasets resolves the source's files)",
        "startup": "the rest of start-up: the encoder's preprocessing config, the writer and the encoder's loader",
        "scan": "reading rows from the stream and checking their text columns",
        "media_wait": "waiting for workers' tokenized and decoded rows (with 0 workers: doing that work)",
        "encode_wait": "waiting for the encode thread to finish the shard before the one just gathered "
                       "(its own seconds: the report's encode_seconds)",
        "verify_reused": "hashing shards that already exist before reusing them",
        "write_wait": "waiting for the writer thread to finish a shard file",
        "manifest": "manifest lines of written shards",
        "other": "the rest: row bookkeeping, shard keys, the budget checks",
    }

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = defaultdict(float)
        self._open: list[list[Any]] = []  # [phase, since] of the phases entered, innermost last

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        now = time.perf_counter()
        if self._open:
            outer = self._open[-1]
            self.seconds[outer[0]] += now - outer[1]
        self._open.append([phase, now])
        try:
            yield
        finally:
            now = time.perf_counter()
            self.seconds[phase] += now - self._open.pop()[1]
            if self._open:
                self._open[-1][1] = now

    def report(self) -> dict[str, float]:
        total = time.perf_counter() - self.started
        out = {phase: round(self.seconds.get(phase, 0.0), 4) for phase in self.PHASES if phase != "other"}
        out["other"] = round(max(total - sum(self.seconds.values()), 0.0), 4)
        out["total"] = round(total, 4)
        return out


@contextlib.contextmanager
def one_host_thread() -> Iterator[None]:
    """torch's host copies (stacking a shard's items, features to the feature dtype) on one thread. The decode
    workers keep the other cores busy, and an OpenMP team spinning against them is many times slower than one
    thread. Copies give the same bytes on any number of threads; the encoder itself runs outside this, on the
    caller's setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# objects in the permanent generation that the program did not freeze: Python 3.12 moves its immortal objects there
# (375 at start-up, 0 before 3.12 and from 3.13); ObjectsFrozen reads a count above this as the program's own freeze
PARKED_BY_PYTHON = gc.get_freeze_count()


class ObjectsFrozen:
    """Python's cyclic collector kept off the objects prepare did not make. A full collection walks every tracked
    object while each thread of the process waits: with torch, transformers and datasets imported (~0.43 M
    objects) one stalls the decode loop for a sizeable fraction of a second.

    On entry the objects that exist (the imported libraries, the tokenizer) are frozen (``gc.freeze``) and
    collection is off while the run starts; ``settle`` (the first shard gathered, the encoder loaded) freezes what
    the start-up imported meanwhile (``datasets``, the encoder's modules, torchvision) and turns collection back on,
    so what prepare itself allocates is collected as usual. On exit everything is unfrozen (Python 3.12's own
    parked objects too, which its next collection parks again) and collection is as it was. The worker processes
    fork with the objects frozen: their collections do not touch (and copy) the pages they share with this one.
    Left alone entirely where the program froze objects itself.

    "The program froze objects itself" means more objects frozen than the interpreter keeps there on its own:
    Python 3.12 moves its immortal objects (375 tuples at start-up) into the permanent generation, so a freeze count
    of 0 is no sign of an untouched program; the comparison is against that count (``PARKED_BY_PYTHON``, read at
    import)."""

    def __init__(self) -> None:
        self.active = False
        self.was_enabled = True

    def __enter__(self) -> ObjectsFrozen:
        if gc.get_freeze_count() <= PARKED_BY_PYTHON:
            self.active, self.was_enabled = True, gc.isenabled()
            gc.disable()
            gc.freeze()
        return self

    def settle(self) -> None:
        """The objects made since entry frozen too, and collection on again (where it was on)."""
        if self.active:
            gc.freeze()
            if self.was_enabled:
                gc.enable()

    def __exit__(self, *exc: Any) -> None:
        if self.active:
            self.active = False
            gc.unfreeze()
            if self.was_enabled:
                gc.enable()


def in_thread(name: str, fn: Any, *args: Any) -> Future:
    """``fn(*args)`` on a thread of its own, named ``name``; the thread ends with its one task."""
    pool = ThreadPoolExecutor(1, thread_name_prefix=name)
    try:
        return pool.submit(fn, *args)
    finally:
        pool.shutdown(wait=False)  # the submitted task still runs


# -- decode workers --------------------------------------------------------------------------------------


_WORKER_DECODER: Any = None  # the run's row decoder: rows(chunk, slots, slot)
_WORKER_SLOTS: SharedSlots | None = None  # inherited through fork, never pickled


def _init_media_worker(decoder: Any, slots: SharedSlots | None = None) -> None:
    global _WORKER_DECODER, _WORKER_SLOTS
    with contextlib.suppress(Exception):  # Linux: a killed run takes its workers with it (they would wait forever)

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    torch.set_num_threads(1)  # one decode per process; torch only stacks here
    _WORKER_DECODER, _WORKER_SLOTS = decoder, slots


def _decode_chunk(chunk: list[Any], slot: int | None = None) -> tuple[list[Any], list[Any], Any, tuple[float, float]]:
    assert _WORKER_DECODER is not None
    return _WORKER_DECODER.rows(chunk, _WORKER_SLOTS, slot)


def unstack(results: list[Any], stacked: torch.Tensor | None) -> list[Any]:
    """``MediaDecoder.rows``' answer back to per-row ``(hashes, items)`` or ``(kind, reason)``."""
    if stacked is None and not any(r is not None and isinstance(r[1], int) for r in results):
        return results
    out, at = [], 0
    for result in results:
        if result is None:
            out.append(None)
            continue
        first, second = result
        if isinstance(first, list):
            out.append((first, list(stacked[at : at + second]) if second else []))
            at += second
        else:
            out.append((first, second))
    return out


def with_items(results: list[Any], change: Callable[[list[Any]], list[Any]]) -> list[Any]:
    """``MediaDecoder.rows``' per-row answers with each good row's items ``change``d (a worker's ``hand_over``, the
    main process's ``take_over``); rows given as None and bad rows' ``(kind, reason)`` as they are."""
    return [(r[0], change(r[1])) if r is not None and isinstance(r[0], list) else r for r in results]


def _taken_over(results: list[Any], view: Callable[[SlotBytes], Any], preprocess: Any) -> list[Any]:
    """``MediaDecoder.rows``' answer for a chunk whose payloads a worker put into a slot: each row's items with
    every ``SlotBytes`` they name viewed in the slot (``preprocess.take_over``; ``view``: ``take_payloads``)."""
    return with_items(results, lambda items: preprocess.take_over(items, view))


def fork_available() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


def media_pool(workers: int, decoder: Any, slots: SharedSlots | None = None) -> Executor | None:
    """Worker processes for ``decoder`` (its ``rows(chunk, slots, slot)`` decodes a chunk), started now; None for 0 (decode in this process). Forked where the
    platform can (as torch's DataLoader does: the workers never touch CUDA), so starting them costs milliseconds,
    not imports, and they inherit the loaded tokenizer and ``slots`` (only a forked worker can: ``slots`` needs
    ``fork_available()``)."""
    if workers == 0:
        return None

    method = "fork" if fork_available() else "spawn"
    if slots is not None and method != "fork":
        raise ValueError("shared slots reach the decode workers only through fork")
    pool = ProcessPoolExecutor(workers, mp_context=mp.get_context(method), initializer=_init_media_worker,
                               initargs=(decoder, slots))
    pool.submit(int)  # a forking pool starts every worker at its first task: now, before the run starts threads
    return pool


MEDIA_CHUNK_ROWS = 64  # rows per worker task: large enough to amortise the hand-over, small enough to pipeline


def shard_chunks(shard_rows: int) -> int:
    """Worker tasks (chunks of ``MEDIA_CHUNK_ROWS``) a shard's rows take."""
    return -(-shard_rows // MEDIA_CHUNK_ROWS)


def chunks_ahead(workers: int, shard_rows: int) -> int:
    """Worker tasks in flight ahead of the row the run is at: a shard's rows, and at least 4 chunks per worker."""
    return max(4 * workers, shard_chunks(shard_rows))


def media_slots(preprocess: Any, workers: int, shard_rows: int) -> SharedSlots | None:
    """Shared slots for forked workers' chunks when ``preprocess`` declares its item shape (a chunk's stack), or
    the room its ``hand_over`` may fill per item (``slot_bytes_per_item``: a chunk's payloads), else None. Enough
    for the chunks in flight, the shard being gathered and the one being encoded (a row's items stay in its
    chunk's slot until the row's shard is encoded); a chunk that finds none free travels as it would without."""
    shape = getattr(preprocess, "item_shape", None)
    hands_over = hasattr(preprocess, "hand_over") and hasattr(preprocess, "take_over")
    per_item = getattr(preprocess, "slot_bytes_per_item", None) if hands_over else None
    if not workers or (shape is None and per_item is None) or not fork_available():
        return None
    count = chunks_ahead(workers, shard_rows) + 2 * shard_chunks(shard_rows) + 2
    try:
        if shape is None:
            return SharedSlots(count, MEDIA_CHUNK_ROWS * int(per_item))
        return SharedSlots.for_items(tuple(shape), getattr(preprocess, "item_dtype", torch.uint8), MEDIA_CHUNK_ROWS,
                                     count)
    except OSError:  # the mapping was refused (a strict overcommit limit): every chunk travels as it would without
        return None


def stack_chunk(results: list[Any], preprocess: Any, slots: SharedSlots | None,
                slot: int | None) -> tuple[list[Any], torch.Tensor | SlotRef | None]:
    """A chunk's per-row ``(hashes, items)`` or ``(kind, reason)`` (None for a row given as None) as they travel
    back from a worker: with ``preprocess``, the rows' tensors are stacked into one (one shared-memory transfer per
    chunk; into ``slots``' slot ``slot`` when given and the stack fits it) and each good row holds its count
    instead of its items. A preprocess that does not stack but hands over (``hand_over``) puts its items' payloads
    into the slot instead (``SlotWriter``)."""
    if preprocess is None or not getattr(preprocess, "stacks", True):
        hand_over = getattr(preprocess, "hand_over", None)
        if hand_over is None or slots is None or slot is None:
            return results, None
        writer = slots.writer(slot)
        return with_items(results, lambda items: hand_over(items, writer.put)), writer.ref()
    tensors = [t for r in results if r is not None and isinstance(r[0], list) for t in r[1]]
    stacked: torch.Tensor | SlotRef | None = None
    if tensors:
        fits = slots is not None and slot is not None and slots.fits(tensors)
        stacked = slots.stack_into(slot, tensors) if fits else torch.stack(tensors)  # type: ignore[union-attr]
    return [(r[0], len(r[1])) if r is not None and isinstance(r[0], list) else r for r in results], stacked


class ChunkDecoding:
    """Chunks of row jobs decoded ahead of the row the run is at: a shard's rows (at least 4 chunks per worker)
    are in the workers while the main process encodes and writes a shard, so the workers keep busy. Counts how
    each chunk's stacked media came back (``media_chunks``: a shared slot mapped once per run, or a shared-memory
    segment of its own) and the seconds the decode work took in whichever process ran it (``worker_seconds``)."""

    def __init__(self, pool: Executor | None, slots: SharedSlots | None, preprocess: Any, shard_rows: int,
                 clock: PhaseClock) -> None:
        self.pool, self.preprocess, self.clock = pool, preprocess, clock
        self.slots = slots if pool is not None else None  # without a pool no chunk takes or returns a slot
        self.ahead = 0 if pool is None else chunks_ahead(getattr(pool, "_max_workers", 1), shard_rows)
        self.worker_seconds = {"prompt": 0.0, "media": 0.0}
        self.media_chunks = {"shared_slot": 0, "own_segment": 0}

    def answers(self, rows: Iterator[Any], job: Callable[[Any], Any],
                local: Callable[[list[Any]], Any]) -> Iterator[tuple[list[Any], Iterator[Any], Iterator[Any]]]:
        """``rows`` back in chunks of ``MEDIA_CHUNK_ROWS``, in order, as ``(chunk, measured, media)``: the decoder's
        answer for the chunk's jobs (``job(row)``, None for a row with nothing to decode; ``local(jobs)`` here when
        there is no pool, at the moment the run reaches the chunk) as per-job iterators of token counts and
        ``(hashes, items)`` or ``(kind, reason)``."""
        window: deque[tuple[Any, Any, int | None]] = deque()
        try:
            while chunk := list(itertools.islice(rows, MEDIA_CHUNK_ROWS)):
                todo = [j for j in map(job, chunk) if j is not None]
                slot = None
                if not todo:
                    pending = None
                elif self.pool is None:
                    pending = functools.partial(local, todo)  # decoded when the run reaches it
                else:
                    slot = self.slots.acquire() if self.slots is not None else None
                    pending = self.pool.submit(_decode_chunk, todo, slot)
                window.append((chunk, pending, slot))
                while len(window) > self.ahead:
                    yield self._done(*window.popleft())
            while window:
                yield self._done(*window.popleft())
        finally:
            for _, pending, _ in window:  # the run stopped early (enough rows, or an error): drop what is ahead
                if isinstance(pending, Future):
                    pending.cancel()

    def _done(self, chunk: Any, pending: Any, slot: int | None) -> tuple[Any, Iterator[Any], Iterator[Any]]:
        with self.clock("media_wait"):  # with 0 workers: the tokenizing and decoding themselves
            answer = pending.result() if isinstance(pending, Future) else pending() if pending else None
        if answer is None:
            return chunk, iter(()), iter(())
        counts, media, stacked, (prompt_s, media_s) = answer
        slots = self.slots
        if isinstance(stacked, SlotRef):
            self.media_chunks["shared_slot"] += 1
            if getattr(self.preprocess, "stacks", True):
                stacked = slots.take(stacked)  # type: ignore[union-attr]
            else:  # the items' payloads, not a stack (hand_over)
                media = _taken_over(media, slots.take_payloads(stacked), self.preprocess)  # type: ignore[union-attr]
                stacked = None
        else:
            if slot is not None:  # nothing was written into it
                slots.release(slot)  # type: ignore[union-attr]
            if stacked is not None and self.pool is not None:
                self.media_chunks["own_segment"] += 1
        self.worker_seconds["prompt"] += prompt_s
        self.worker_seconds["media"] += media_s
        return chunk, iter(counts), iter(unstack(media, stacked))


class Executors:
    """A run's decode workers (``decoding``), shard-writer threads (``writer``) and encode thread
    (``encoding``), started and shut down together; the workers start first, before the threads."""

    def __init__(self, decoder: Any, preprocess: Any, workers: int, shard_rows: int,
                 clock: PhaseClock) -> None:
        with clock("workers_start"):
            slots = media_slots(preprocess, workers, shard_rows)
            self.pool = media_pool(workers, decoder, slots)
            self.decoding = ChunkDecoding(self.pool, slots, preprocess, shard_rows, clock)
        self.writer = ThreadPoolExecutor(SHARD_WRITERS, thread_name_prefix="stitch-shard-writer")
        self.encoding = ThreadPoolExecutor(1, thread_name_prefix="stitch-encode")

    def shutdown(self) -> None:
        """A shard being encoded is finished and handed to the writer (those queued behind it are dropped),
        then a shard being written is finished (or its temp file removed), then the decode workers stop."""
        self.encoding.shutdown(wait=True, cancel_futures=True)
        self.writer.shutdown(wait=True)
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


# -- the encode thread ----------------------------------------------------------------------------------


class ShardEncoder:
    """The encoder's side of a run. ``load()`` runs on first need, or, after ``preload``, in a thread of its own
    from the start of a fresh run, so loading overlaps decoding the first shard; ``ready(encoder)`` runs once it is
    there. ``encode`` runs on the encode thread, which encodes a shard while the main thread gathers the next: on a
    GPU the encoder's own host work (nvjpeg's host half, launches) then overlaps the scanning and the hand-over."""

    def __init__(self, load: Callable[[], Any], ready: Callable[[Any], None], preprocess: Any, device: str,
                 dtype: torch.dtype, batch_size: int, encoder: Any = None) -> None:
        self._load, self._ready, self.preprocess, self.device = load, ready, preprocess, device
        self.dtype, self.batch_size = dtype, batch_size
        # host buffers the encoder's device copies from and to: pinned, so the copies do not block the host
        self.pinned = device.startswith("cuda") and torch.cuda.is_available()
        self._encoder = encoder
        self._encoder_ready = False
        self._loading: Future | None = None  # the encoder, loading in a thread while the first rows decode
        self._warming_inputs: Future | None = None  # the device preprocessing's set-up, in a thread beside it
        self.seconds = dict.fromkeys(ENCODE_PHASES, 0.0)  # added to by the encode thread only

    def load(self, warm: bool = False) -> Any:
        """The encoder; ``warm``: also run its optional ``warm_up(batch_size)`` (CUDA context, library handles and
        kernels of the first batch), which the loader thread does so the first shard's encode does not wait for it."""
        encoder = self._load()
        if warm and callable(getattr(encoder, "warm_up", None)):
            encoder.warm_up(self.batch_size)
        return encoder

    def preload(self) -> None:
        """Start loading the encoder (weights, CUDA) in a thread, unless one was given. A device preprocessing's
        ``warm_up(device)`` (CLIP's: nvjpeg's decoder and the resize's GEMMs) runs in a second thread beside the
        load, not after it: otherwise the loader, not the gathering, holds back the first shard."""
        if self._encoder is None:
            self._loading = in_thread("stitch-encoder-load", self.load, True)
            if callable(getattr(self.preprocess, "device_batch", None)) and \
                    callable(warm_inputs := getattr(self.preprocess, "warm_up", None)):
                self._warming_inputs = in_thread("stitch-inputs-warm-up", warm_inputs, self.device)

    @property
    def encoder(self) -> Any:
        if self._encoder is not None and self._encoder_ready:
            return self._encoder
        if self._encoder is None:  # loaded only when a shard is missing: a full re-run never loads it
            self._encoder = self._loading.result() if self._loading is not None else self.load()
        if not self._encoder_ready:
            self._encoder_ready = True
            self._ready(self._encoder)
        return self._encoder

    def batch(self, items: list[Any]) -> Any:
        """What one encoder call takes: the list of decoded items, or preprocessed tensors stacked into one
        (in pinned memory when the encoder is on CUDA, so the copy to the device is asynchronous), or the batch a
        preprocessing that finishes on the device (``device_batch``) made there."""
        if self.preprocess is None or not items:  # decode_item's items (a plugin's may differ in shape)
            return items
        if callable(finish := getattr(self.preprocess, "device_batch", None)):
            return finish(items, self.device)
        out = torch.empty((len(items), *items[0].shape), dtype=items[0].dtype, pin_memory=self.pinned)
        with one_host_thread():
            return torch.stack(items, out=out)

    def encode(self, items: list[tuple[str, Any]], row_ends: set[int], shape: tuple[int, ...],
               check: Callable[[torch.Tensor, list[tuple[str, Any]]], None],
               advance: Callable[[int], None]) -> torch.Tensor:
        """Features of every ``(row id, item)`` in order, ``shape`` each; ``check(features, batch)`` judges each
        call's answer; ``advance(rows)`` as the rows whose last item (``row_ends``) is done. The first batch's
        input is made before the encoder is waited for: on a fresh run the encoder may still be loading."""
        started, inputs = time.perf_counter(), 0.0  # the thread's seconds here, and those making the inputs
        if self._warming_inputs is not None:  # the device preprocessing's set-up finished (or its error raised)
            warming, self._warming_inputs = self._warming_inputs, None
            warming.result()
        waited = time.perf_counter() - started  # start-up, counted as the encoder's loading
        encoder = None
        # each batch lands in place (no cat); on a GPU in pinned memory, so a batch's features come back while the
        # host stacks the next batch, and the host waits once, for the last copy
        out = torch.empty((len(items), *shape), dtype=self.dtype, pin_memory=self.pinned)
        step = self.batch_size
        for start in range(0, len(items), step):
            batch = items[start : start + step]
            making = time.perf_counter()
            with torch.inference_mode():
                pixels = self.batch([item for _, item in batch])
                inputs += time.perf_counter() - making
                if encoder is None:  # loads (or waits for) the encoder, into its own phase
                    asked = time.perf_counter()
                    encoder = self.encoder
                    waited += time.perf_counter() - asked
                features = encoder.encode(pixels)
            check(features, batch)
            with one_host_thread():
                out[start : start + len(batch)].copy_(features.detach(), non_blocking=features.is_cuda)
            advance(sum(1 for end in row_ends if start < end <= start + len(batch)))
        if self.pinned:
            torch.cuda.current_stream().synchronize()  # every copy into ``out`` has landed before it is written
        self.seconds["encoder_load"] += waited
        self.seconds["inputs"] += inputs
        self.seconds["encode"] += time.perf_counter() - started - inputs - waited
        return out
