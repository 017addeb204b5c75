"""GPU path: moving a snapshot's bytes between GPU memory and the agent's host memory, off the
training stream. Used only when state tensors live on a CUDA device; nothing here runs on CPU jobs.

Snapshot (device -> host), :class:`SnapshotStaging`:

* the agent's slots, mapped by the trainer, are **registered with CUDA** (``cudaHostRegister``:
  page-locked), so the copy engine writes the slot directly at the link's speed: no bounce buffer,
  no second host copy. Registration happens once per slot and process (on the engine's worker, before
  the first copy into a layout's slots; :func:`page_lock_files`); the process keeps its page-locked
  mappings across engines (an in-process restart) until it page-locks other slots;
* at ``snapshot()`` the training thread only records an event on its current stream (the point
  after the optimizer step) and returns;
* the engine's worker thread makes a dedicated stream wait for that event, enqueues every chunk's
  copies on it with one event per chunk, and sums each chunk on the host as soon as its event has
  completed, in a few threads (up to ``restore_read.MAX_GPU_HOST_THREADS``), while later chunks are
  still in flight. The next forward/backward runs on the training stream meanwhile; the engine's
  ``wait()`` before the next optimizer step returns only after the last copy and sum (host-side),
  so the step cannot change bytes in flight;
* or (``sums="device"``, the default where Triton runs) the chunks' checksums are computed on the GPU
  from the source tensors, on a second, high-priority stream that also waits for that event, queued
  once the copies are (the copy engine has started): one Triton launch for every piece reads each byte
  once, while the copy engine moves the same bytes; the copies never wait for the sums (docs/gpu.md:
  why one launch).

Restore (host -> device), :class:`RestoreStaging`: per restore thread, a stream of its own, which
first waits for an event the restoring thread recorded on its current stream (:class:`RestoreStagings`:
the destinations' allocation or zero-fill queued there lands first). From a slot that is page-locked
in this process (:func:`page_locked_file`: an in-process restart, whose earlier engine page-locked
it) the copy engine reads the slot straight into the tensors, and the lanes of all those pieces are
summed in one launch queued behind every copy (:meth:`RestoreStagings.after_copies`, with the value
guard's reads: both launched while the copies are in flight, run as soon as the bytes have landed).
A fresh process (no engine of it page-locked the slot) on a huge-page tmpfs page-locks the slot itself,
in ranges on several threads (:func:`page_lock_while_copying`), and copies each range straight from the
slot as soon as it is locked, while later ranges are still being locked (page-locking a whole 16 GiB
slot first took longer than the copy on the H200); the process keeps it for its snapshots. Otherwise
(4 KiB pages, where page-locking costs twice the bounce's time: :data:`FRESH_RESTORE`; or a range that
could not be page-locked) the bytes go through pinned bounce blocks in rotation: a block is read
from the slot and copied to the device, and refilled only after its copy's event has completed; each
piece's lanes are computed on its stream after its copies. The restore combines the lanes with the
host pieces' and compares every chunk with its stored checksum after ``finish()`` (every copy done).
A mismatch fails the restore as on CPU (the caller then overwrites or discards
the partly written state).

Checksums on the device use :mod:`megatron_ft.capture.lanes_kernel` where Triton runs, else torch
reductions (:func:`checksum.tensor_lanes`).

Memory: pinned host memory is the registered slots (owned by the agent, mapped and page-locked by the
trainer's process until it exits or page-locks other slots) and the restore's bounce blocks (threads x
``BLOCKS`` x block size, from torch's pinned-memory cache; none when the slot is page-locked). No
on-device shadow copy: the GPU memory used beyond the training state is the checksums' temporaries
(with the kernel, 128 bytes per MiB summed and per piece; without, about ``checksum.LANE_BLOCK`` per
thread), freed to torch's cache.

If registration fails (an old driver, a locked-memory limit), copies into the unregistered slot
still work (the driver stages them: correct and synchronous per copy, much slower); that is logged
once with the reason.

Parts: page-locking the slot files (:class:`PageLockedFile`, the process's page-locked slots, a fresh
process's page-locking while it copies) is :mod:`.page_locked`'s, re-exported here; so are its
settings (``page_locked.LOCK_RANGE``, ``LOCK_ALIGN``, ``LOCK_WAIT_S``), set there. The streams, the
stagings, and the names their paths look up when called (:func:`on_device`, :func:`pinned_bytes`,
:func:`default_sums`, :data:`FRESH_RESTORE`) are this module's: set here, they take effect.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, Optional, Sequence

import numpy as np
import torch

from ..capture import checksum
from .page_locked import (_SAID, HostRegistration, PageLockedFile, forget_page_locked, lock_ranges, made_current,
                          page_lock_files, page_lock_while_copying, page_locked_file, release_page_locked)

__all__ = [
    # page-locking the slot files (page_locked)
    "HostRegistration", "made_current", "lock_ranges", "PageLockedFile", "page_lock_files", "forget_page_locked",
    "page_locked_file", "release_page_locked", "page_lock_while_copying", "_SAID",
    # the streams and the stagings (here)
    "BLOCKS", "on_device", "cuda_device_of", "devices_of", "stream_point", "pinned_bytes", "FRESH_RESTORE",
    "FRESH_RESTORE_CHOICES", "lock_while_copying", "SnapshotStaging", "SUM_PLACES", "default_sums",
    "RestoreStaging", "RestoreStagings",
]

log = logging.getLogger("megatron_ft.trainer.device_staging")

#: restore bounce blocks per thread: one being read and summed, two in flight to the device
BLOCKS = 3


def on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in GPU memory (the one test of this module's paths)."""
    return t.device.type == "cuda"


def cuda_device_of(tensors: Sequence[torch.Tensor]) -> Optional[torch.device]:
    """The CUDA device of the first CUDA tensor in ``tensors``, or None (a CPU job)."""
    for t in tensors:
        if on_device(t):
            return t.device
    return None


def devices_of(tensors: Iterable[torch.Tensor]) -> list[torch.device]:
    """The distinct devices of the GPU tensors in ``tensors``, in order of appearance (none: a CPU job)."""
    return list(dict.fromkeys(t.device for t in tensors if on_device(t)))


def stream_point(device: torch.device, stream: Optional[torch.cuda.Stream] = None) -> torch.cuda.Event:
    """An event recorded now on ``stream`` (default: the calling thread's current stream of ``device``):
    work queued later on another stream that waits for it runs after everything queued there so far."""
    ev = torch.cuda.Event()
    ev.record(stream if stream is not None else torch.cuda.current_stream(device))
    return ev


def pinned_bytes(n: int) -> torch.Tensor:
    """``n`` bytes of page-locked host memory (torch's pinned-memory cache)."""
    return torch.empty(n, dtype=torch.uint8, pin_memory=True)


#: a fresh process's restore from a slot no earlier engine of the process page-locked: ``auto`` page-locks
#: the slot while copying (:func:`page_lock_while_copying`) where the slot is on a huge-page tmpfs, and
#: goes through pinned bounce blocks on 4 KiB pages (where page-locking costs more than the bounce:
#: docs/gpu.md); ``page-lock`` and ``bounce`` choose one everywhere (the GPU benchmark compares them)
FRESH_RESTORE = "auto"
FRESH_RESTORE_CHOICES = ("auto", "page-lock", "bounce")


def lock_while_copying(backing: str, choice: Optional[str] = None) -> bool:
    """Whether a fresh process's restore page-locks a slot whose directory has page ``backing``
    (:func:`megatron_ft.agent.shm.page_backing`) while copying it, rather than reading it through
    bounce blocks.

    >>> [lock_while_copying(b, c) for b, c in [("huge", "auto"), ("small", "auto"), ("small", "page-lock")]]
    [True, False, True]
    >>> lock_while_copying("huge", "sometimes")
    Traceback (most recent call last):
    ...
    ValueError: FRESH_RESTORE 'sometimes': one of ('auto', 'page-lock', 'bounce')
    """
    choice = FRESH_RESTORE if choice is None else choice
    if choice not in FRESH_RESTORE_CHOICES:
        raise ValueError(f"FRESH_RESTORE {choice!r}: one of {FRESH_RESTORE_CHOICES}")
    return choice == "page-lock" or (choice == "auto" and backing == "huge")


class SnapshotStaging:
    """Device -> host copies of one rank's snapshots into its registered agent slots, and the chunks'
    checksums: summed on the device from the source bytes (``sums="device"``, the default where the
    Triton kernel runs) or on the host as each chunk lands (``sums="host"``).

    Owned by a :class:`~megatron_ft.trainer.snapshot.SnapshotEngine`: :meth:`ready_point` and
    :meth:`unregister` run on the training thread (the latter while the worker is idle),
    :meth:`register` and :meth:`copy_and_sum` on the engine's worker thread (one snapshot at a time),
    :meth:`close` after the worker has stopped. Its sum threads release the GIL (native checksum)
    and sleep on the chunks' events (blocking-sync events).

    Device sums run on a second stream of high priority, so that the copies never queue behind them
    and their blocks are scheduled ahead of the training kernels' as SMs free up: one kernel launch for
    every piece reads the bytes once, while the copy engine moves the same bytes to the slot."""

    def __init__(self, device: torch.device, sum_threads: int, sums: Optional[str] = None):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.sums = sums or default_sums()
        if self.sums not in SUM_PLACES:
            raise ValueError(f"snapshot sums {self.sums!r}: one of {SUM_PLACES}")
        self.sum_stream = torch.cuda.Stream(device=device, priority=-1)  # the highest priority torch offers
        self.files: list[Optional[PageLockedFile]] = []  # per slot index: the slot page-locked (None: not)
        self._pool = ThreadPoolExecutor(max(1, sum_threads), thread_name_prefix="mft-d2h-sum")
        self._warned = False
        self.register_s = 0.0  # the last registration's time (page-locking is paid once per layout)
        self.last_phases: dict = {}  # device sums: seconds from copy_and_sum's start to each of its points

    def register(self, slots: Sequence) -> list[str]:
        """Page-lock every slot in ``slots`` (objects with a ``path``) in this process, or reuse the
        process's earlier page-locking of the same files (:func:`page_lock_files`), and copy into those
        mappings from now on (:attr:`areas`); the reasons of any that could not be page-locked (empty: all
        pinned; those slots are written through the caller's own mapping, staged by the driver)."""
        t0 = time.perf_counter()
        self.files, errors, fresh = page_lock_files([slot.path for slot in slots], self.device)
        self.register_s = time.perf_counter() - t0
        log.info("page-locked %d snapshot slot(s) in %.2f s (%d already page-locked by this process)", fresh,
                 self.register_s, sum(a is not None for a in self.areas) - fresh)
        if errors and not self._warned:
            self._warned = True
            log.warning("could not page-lock %d snapshot slot(s) for the GPU (%s): device-to-host copies will be "
                        "staged by the driver, synchronously and slower", len(errors), errors[0])
        return errors

    def unregister(self) -> None:
        """Stop using the page-locked mappings (a new layout's slots are registered next). The process
        keeps them for a restore until :func:`page_lock_files` is given other files."""
        self.files = []

    @property
    def areas(self) -> list[Optional[np.ndarray]]:
        """Per slot index: its page-locked mapping, the whole file (None: not page-locked)."""
        return [f.array if f is not None else None for f in self.files]

    def ready_point(self) -> torch.cuda.Event:
        """Training thread, right after the optimizer step: an event on the current stream that the
        copies wait for."""
        return stream_point(self.device)

    def copy_and_sum(self, ready: torch.cuda.Event, area: np.ndarray, pieces_by_chunk: list,
                     chunk_bounds: Callable[[int], tuple[int, int]], sources: list[torch.Tensor],
                     after_first_chunk: Callable[[], None] = lambda: None,
                     cut: Optional[Callable[[int, int], list[tuple[int, int]]]] = None) -> list[int]:
        """Copy every piece of every chunk into ``area`` (the slot's data area) and return the chunks'
        checksums (:data:`checksum.ALGORITHM`, as :class:`checksum.ChunkSum` computes them from the
        assembled bytes). ``sources[i]`` is entry i's saved bytes (flat uint8, on the device or on the
        host). ``cut(lo, hi)``: ``area[lo:hi]`` in pieces that each lie in one page-locked range
        (:meth:`PageLockedFile.pieces`), one copy each. Blocks until every copy and sum is done; an error
        leaves no copy running."""
        with made_current(self.device):  # every CUDA call of this (worker) thread on the rank's device
            return self._copy_and_sum(ready, area, pieces_by_chunk, chunk_bounds, sources, after_first_chunk,
                                      cut or (lambda lo, hi: [(lo, hi)]))

    def _copy_and_sum(self, ready: torch.cuda.Event, area: np.ndarray, pieces_by_chunk: list,
                      chunk_bounds: Callable[[int], tuple[int, int]], sources: list[torch.Tensor],
                      after_first_chunk: Callable[[], None],
                      cut: Callable[[int, int], list[tuple[int, int]]]) -> list[int]:
        t0 = time.perf_counter()
        self.last_phases = {}
        if self.sums == "device" and default_sums() == "host":
            self.sums = "host"  # the kernel failed (said once): torch's reductions would be slower than the host
        device_sums = self.sums == "device"
        dst = torch.from_numpy(area)
        events: list[Optional[torch.cuda.Event]] = []

        def sum_chunk(i: int) -> int:  # (a pool thread: the rank's device made current for its CUDA call)
            landed = events[i]
            if landed is not None:
                with made_current(self.device):
                    landed.synchronize()
            lo, hi = chunk_bounds(i)
            chunk = checksum.ChunkSum(hi - lo)
            for p in pieces_by_chunk[i]:
                chunk.add(p.dst_offset - lo, area[p.dst_offset: p.dst_offset + (p.src_end - p.src_start)])
            return chunk.finish()

        try:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(ready)
                for i, pieces in enumerate(pieces_by_chunk):
                    from_device = False
                    for p in pieces:
                        src = sources[p.entry_index][p.src_start:p.src_end]
                        for lo, hi in cut(p.dst_offset, p.dst_offset + src.numel()):
                            part = src[lo - p.dst_offset: hi - p.dst_offset]
                            dst[lo:hi].copy_(part, non_blocking=on_device(part))
                        from_device = from_device or on_device(src)
                    landed = None
                    if from_device and not device_sums:  # host sums wait for each chunk's copies
                        landed = torch.cuda.Event(blocking=True)  # its waiter sleeps rather than spins
                        landed.record(self.stream)
                    events.append(landed)
                    if i == 0:
                        after_first_chunk()
                copied = torch.cuda.Event(blocking=True)
                copied.record(self.stream)
            if not device_sums:
                return list(self._pool.map(sum_chunk, range(len(pieces_by_chunk))))
            t1 = time.perf_counter()
            # device sums once the copies are queued (the copy engine starts at once; building the one
            # launch costs the CPU 1-15 ms at 1-16 GiB), reading the sources beside the copies
            lanes, done = self._sum_on_device(ready, pieces_by_chunk, sources)
            t2 = time.perf_counter()
            copied.synchronize()  # every copy landed (host pieces' bytes are summed from the slot)
            t3 = time.perf_counter()
            done.synchronize()
            self.last_phases = {"queue_copies": t1 - t0, "queue_sums": t2 - t1, "copies_landed": t3 - t0,
                                "sums_landed": time.perf_counter() - t0}
            on_host = iter(lanes.tolist())  # (the lanes were copied to page-locked memory, after the sums)
            sums = []
            for i, pieces in enumerate(pieces_by_chunk):
                lo, hi = chunk_bounds(i)
                parts = []
                for p in pieces:
                    if on_device(sources[p.entry_index]):
                        parts.append((p.dst_offset - lo, next(on_host)))
                    else:
                        parts.append((p.dst_offset - lo, checksum.host_lanes(
                            area[p.dst_offset: p.dst_offset + (p.src_end - p.src_start)])))
                sums.append(checksum.combine_lanes(hi - lo, parts))
            return sums
        finally:
            self.stream.synchronize()  # an error above must not leave copies writing the slot
            self.sum_stream.synchronize()

    def _sum_on_device(self, ready: torch.cuda.Event, pieces_by_chunk: list,
                       sources: list[torch.Tensor]) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Queue the lanes of every device piece (in chunk order) on the sum stream after ``ready``; the
        lanes land in one page-locked (pieces, 16) int64 tensor, complete when the returned event is."""
        device_pieces = [p for pieces in pieces_by_chunk for p in pieces if on_device(sources[p.entry_index])]
        with torch.cuda.stream(self.sum_stream):  # (the worker's device made current by copy_and_sum)
            self.sum_stream.wait_event(ready)
            lanes = torch.empty(len(device_pieces), 16, dtype=torch.int64, device=self.device)
            checksum.pieces_lanes([sources[p.entry_index][p.src_start:p.src_end] for p in device_pieces], lanes)
            host = pinned_bytes(lanes.numel() * 8).view(torch.int64).view(lanes.shape)
            host.copy_(lanes, non_blocking=True)
            done = torch.cuda.Event(blocking=True)
            done.record(self.sum_stream)
        return host, done

    def close(self) -> None:
        """After the worker has stopped. The page-locked mappings stay with the process (an in-process
        restart restores from them and its next engine snapshots into them)."""
        self._pool.shutdown(wait=True)
        self.stream.synchronize()
        self.sum_stream.synchronize()
        self.unregister()


#: where :class:`SnapshotStaging` sums a snapshot's device bytes
SUM_PLACES = ("device", "host")


def default_sums() -> str:
    """``device`` where the Triton checksum kernel can run (one read of the bytes in GPU memory, beside
    the copy), else ``host`` (the torch reductions on the device cost more than summing on the host)."""
    from ..capture import lanes_kernel

    return "device" if lanes_kernel.AVAILABLE else "host"


class RestoreStaging:
    """One restore thread's host -> device path: pinned bounce blocks in rotation, its own stream.

    Used by one thread only; each method makes the staging's device current for its CUDA calls (the
    restore's pool threads start on device 0). Its stream first waits for ``after`` (the restore's start on the
    caller's stream: see :class:`RestoreStagings`). :meth:`block` hands out the next block once its
    earlier copy has completed; :meth:`upload` copies a filled block to the device asynchronously;
    :meth:`finish` waits for every copy."""

    def __init__(self, device: torch.device, block_bytes: int, after: torch.cuda.Event):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.stream.wait_event(after)  # nothing of the restore lands before what the caller queued
        self._block_bytes = block_bytes
        self._blocks: list[torch.Tensor] = []  # allocated on first use: a restore from a page-locked slot has none
        self._events: list[Optional[torch.cuda.Event]] = [None] * BLOCKS
        self._next = 0

    def block(self) -> tuple[int, torch.Tensor]:
        with made_current(self.device):  # (a restore thread: its own current device is 0)
            if not self._blocks:
                self._blocks = [pinned_bytes(self._block_bytes) for _ in range(BLOCKS)]
            k = self._next
            self._next = (k + 1) % BLOCKS
            ev = self._events[k]
            if ev is not None:
                ev.synchronize()
                self._events[k] = None
            return k, self._blocks[k]

    def upload(self, k: int, dst: torch.Tensor) -> None:
        """Copy the first ``dst.numel()`` bytes of block ``k`` into ``dst`` (a uint8 view of device memory)."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            dst.copy_(self._blocks[k][: dst.numel()], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
            self._events[k] = ev

    def upload_page_locked(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy ``src`` (uint8 bytes of page-locked host memory: a registered slot) straight into ``dst``
        (a uint8 view of device memory of the same size), asynchronously: the copy engine reads the slot."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def lanes(self, dst: torch.Tensor) -> torch.Tensor:
        """Checksum lanes of ``dst`` (device bytes), on this thread's stream after its copies."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            return checksum.tensor_lanes(dst)

    def finish(self) -> None:
        self.stream.synchronize()


class RestoreStagings:
    """The :class:`RestoreStaging` of each thread of a restore, created on first use (thread-safe).

    Ordering: created on the thread that asked for the restore, it records one event per device in
    ``devices`` on that thread's current stream (:func:`stream_point`), and every staging stream waits
    for it before its first copy. The destinations were allocated - and perhaps zero-filled or
    initialised - on that stream; without the wait such work, still queued, could land after the
    restored bytes and after their verification. The restore's own threads cannot record it: their
    current stream is the device's default stream, not the caller's. A host-side :meth:`finish`
    ends the restore, so that work the caller queues afterwards follows every copy."""

    def __init__(self, block_bytes: int, devices: Sequence[torch.device] = ()):
        self.block_bytes = block_bytes
        self._after = {d: stream_point(d) for d in devices}
        self._local = threading.local()
        self._all: list[RestoreStaging] = []
        self._joins: list[torch.cuda.Stream] = []  # :meth:`after_copies`'s streams
        self._lock = threading.Lock()

    def here(self, device: torch.device) -> RestoreStaging:
        st = getattr(self._local, "staging", None)
        if st is None or st.device != device:
            if device not in self._after:
                raise ValueError(f"a restore copy to {device}, which was not named when the restore began "
                                 f"(named: {sorted(map(str, self._after))})")
            st = RestoreStaging(device, self.block_bytes, self._after[device])
            self._local.staging = st
            with self._lock:
                self._all.append(st)
        return st

    @contextlib.contextmanager
    def after_copies(self) -> Iterator[None]:
        """Caller's thread, once every copy is queued: inside, the current stream of each device is one
        that waits for every staging stream's copies so far - work queued there (the lanes of pieces
        copied straight from a page-locked slot, the value guard's sums) runs as soon as the bytes have
        landed, its launches made while the copies are still in flight. :meth:`finish` waits for it too."""
        with self._lock:
            stagings = list(self._all)
        with contextlib.ExitStack() as inside:
            for device, after in self._after.items():
                join = torch.cuda.Stream(device=device)
                join.wait_event(after)
                for st in stagings:
                    if st.device == device:
                        join.wait_event(stream_point(device, st.stream))
                self._joins.append(join)
                inside.enter_context(torch.cuda.stream(join))
            yield

    def finish(self) -> None:
        """Every thread's copies done, and what was queued :meth:`after_copies` (call after the threads'
        work, also after an error)."""
        with self._lock:
            for st in self._all:
                st.finish()
        for join in self._joins:
            join.synchronize()
