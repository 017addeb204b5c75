"""Reading a snapshot container back into the tensors it restores: a read plan, one reader per medium.

A restore moves every tensor of a container (a node agent's shared-memory slot, or a persisted file)
into the tensor it restores and verifies each chunk's checksum in the same pass. The work is split the
way ``torch.distributed.checkpoint`` splits a load - plan the reads, then read them:

* :func:`plan_reads` (pure, no byte moves): for every chunk of the layout, the byte ranges of the
  container it holds, the destination bytes each goes to, and the sum the chunk must have;
* :func:`choose_reader`: once per restore, the :class:`Reader` for the medium the bytes come from and
  go to;
* :func:`read_verified`: the plan run with that reader over the idle cores (:func:`threads_here`; the
  reads and sums release the GIL). After every chunk was read it raises
  :class:`~megatron_ft.capture.snapfile.SnapshotFormatError` naming the first bad chunk (and how many
  more); the destinations may then hold part of the snapshot (the caller handles that).

The readers. On the same containers - whole, truncated, corrupted - every one gives the same verdicts
and bytes (``tests/unit/test_restore_read.py`` runs each over them):

=================  ==========================================================================================
reader             reads
=================  ==========================================================================================
``MappedReader``   CPU tensors from a slot on a huge-page tmpfs: copied from a read-only mapping and summed in
                   one pass (native library). A mapping costs one page-table entry per 2 MiB there; of a
                   4 KiB-page slot it would build and tear down one per 4 KiB, so those are read with pread.
``BlockReader``    CPU tensors from 4 KiB-page memory or disk (native library): ``pread`` in blocks of
                   :data:`READ_BLOCK` into a per-thread buffer that stays in cache, then copied into the
                   tensor and summed in one pass (streaming stores: the tensor's lines are not read first).
                   Reading straight into the tensor and summing it afterwards cost ~10 % more CPU.
``InPlaceReader``  CPU tensors without the native library: ``pread`` straight into the tensor, then summed
                   (numpy).
``DeviceReader``   GPU tensors (CUDA only; its bookkeeping tested on CPU with stubs,
                   ``tests/integration/test_gpu_path_logic.py``): copies queued from a page-locked slot, or
                   through pinned blocks, summed on the device once they have landed; the restore's CPU
                   tensors through the CPU reader it wraps.
=================  ==========================================================================================

Ownership: the plan holds views of the caller's tensors (it owns no memory); a reader owns what it
opened (a mapping, pinned blocks, device streams) until :meth:`Reader.close`, which
:func:`read_verified` always calls; the container's file descriptor stays the caller's.

Worked example: two tensors in 4 KiB chunks - ``w`` spans chunks 0 and 1, ``b`` sits in chunk 1 -
each piece with its offset in the container (its data area starting at byte 8192) and in its chunk
(``b`` 64-byte aligned, at 6,016 of the area):

>>> import torch
>>> from megatron_ft.capture.layout import plan_layout
>>> from megatron_ft.capture.state import StateTensor
>>> tensors = {"w": torch.zeros(1500), "b": torch.zeros(3, dtype=torch.int64)}
>>> layout = plan_layout([StateTensor(n, t).spec() for n, t in tensors.items()], 4096, {})
>>> views = {n: t.reshape(-1) for n, t in tensors.items()}
>>> plan = plan_reads("slot", layout, ["0" * 16, "0" * 16], "xxh3-lanes", 8192, views)
>>> [(c.index, c.nbytes, [(p.name, p.file_offset, p.chunk_offset, p.nbytes) for p in c.pieces])
...  for c in plan.chunks]
[(0, 4096, [('w', 8192, 0, 4096)]), (1, 1944, [('w', 12288, 0, 1904), ('b', 14208, 1920, 24)])]
>>> plan.end  # the container must hold this many bytes
14232
"""
from __future__ import annotations

import abc
import contextlib
import logging
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import numpy as np
import torch

from ..capture import checksum, snapfile
from ..capture.layout import Layout
from . import device_staging

log = logging.getLogger("megatron_ft.trainer.restore_read")

MAX_RESTORE_THREADS = 4
#: GPU path: host threads that read or sum blocks while the copy engine moves others (a GPU node's
#: host cores are otherwise idle then; on the H200 machine 8 reached 38-47 GB/s reading a slot)
MAX_GPU_HOST_THREADS = 8
#: :class:`BlockReader`'s block: a per-thread buffer that stays in cache (a multiple of 32, the checksum
#: groups; smaller blocks, 256 KiB, cost more in per-call overhead than they save)
READ_BLOCK = 4 << 20
#: GPU path: pinned blocks of this size go to the device (fewer, larger copies and fewer Python calls)
GPU_READ_BLOCK = 16 << 20
#: the native library is there: the CPU readers copy and sum in one pass
STREAMING_RESTORE = checksum.HAVE_NATIVE
_PREAD_BLOCK = 1 << 30


def restore_threads(cores: int, local_ranks: int, cap: int = MAX_RESTORE_THREADS) -> int:
    """Threads one rank reads its snapshot back with (read + checksum release the GIL; restore runs
    before training): its share of the cores, since every rank on the node restores at once, at
    least 1 and at most ``cap``. One rank on 2 cores: 2; four ranks on 2 cores:
    1 (with 2 each, 8 threads contended for 2 cores: the 256 MiB x 4 restore took 100-102 ms
    against 74-91 ms with 1, in alternating runs of ``benchmarks/snapshot.py --huge-shm``)."""
    return max(1, min(cap, cores // max(1, local_ranks)))


def threads_here(cap: int = MAX_RESTORE_THREADS) -> int:
    """:func:`restore_threads` for this process: its CPU affinity and torchrun's ``LOCAL_WORLD_SIZE``.
    Also the GPU snapshot's checksum threads (``cap`` :data:`MAX_GPU_HOST_THREADS`)."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local = 1
    return restore_threads(len(os.sched_getaffinity(0)), local, cap)


# ---------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class PieceRead:
    """Bytes of tensor ``name`` at ``file_offset`` of the container, ``chunk_offset`` into their chunk,
    to land in ``dst`` (a uint8 view of the destination: as many bytes)."""
    name: str
    file_offset: int
    chunk_offset: int
    dst: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.dst.numel()


@dataclass(frozen=True)
class ChunkRead:
    """Chunk ``index`` (``nbytes`` long): its pieces, and the sum they must have (hex, as stored)."""
    index: int
    nbytes: int
    expected: str
    pieces: tuple[PieceRead, ...]


@dataclass(frozen=True)
class ReadPlan:
    """Every chunk of container ``path`` (checksum ``algorithm``), and the bytes it must hold (``end``)."""
    path: str
    algorithm: str
    chunks: tuple[ChunkRead, ...]
    end: int

    def verdict(self, chunk: ChunkRead, got: int) -> Optional[str]:
        """None when ``got`` is the chunk's stored sum, else the error naming it."""
        if f"{got:016x}" != chunk.expected:
            return f"{self.path}: chunk {chunk.index} checksum mismatch (stored {chunk.expected}, computed {got:016x})"
        return None


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of the contiguous tensor ``t`` (uint8, same device)."""
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def plan_reads(path: str, layout: Layout, sums: list[str], algorithm: str, data_off: int,
               views: dict[str, torch.Tensor]) -> ReadPlan:
    """The reads of a container at ``path`` whose data area starts at ``data_off``: ``sums`` its stored
    chunk sums, ``views`` every saved tensor's destination (flat, contiguous). Pure."""
    names = [e.spec.name for e in layout.entries]
    flat = {n: byte_view(views[n]) for n in names}
    chunks = []
    for i, pieces in enumerate(layout.all_pieces()):
        lo, hi = layout.chunk_bounds(i)
        chunks.append(ChunkRead(i, hi - lo, sums[i], tuple(
            PieceRead(names[p.entry_index], data_off + p.dst_offset, p.dst_offset - lo,
                      flat[names[p.entry_index]][p.src_start:p.src_end]) for p in pieces)))
    return ReadPlan(path, algorithm, tuple(chunks), data_off + layout.data_nbytes)


# ------------------------------------------------------------------------------------------- the readers
class Reader(abc.ABC):
    """One medium's way of reading a plan's chunks into their destinations and summing them.

    :meth:`read_chunk` runs on the pool's threads (:meth:`threads` of them) and returns the chunk's
    error, or None (verified, or left to :meth:`settle`); :meth:`settle` runs once on the caller's thread
    after every chunk was read or queued and returns the verdicts it held back; :meth:`close` always,
    last."""

    workers_cap = MAX_RESTORE_THREADS

    def __init__(self, plan: ReadPlan, fd: int):
        """A container shorter than ``plan.end`` is refused here, before any byte is read, in the same words
        by every reader (:class:`~megatron_ft.capture.snapfile.SnapshotFormatError`)."""
        self.plan, self.fd = plan, fd
        self.size = os.fstat(fd).st_size
        if self.size < plan.end:
            raise snapfile.SnapshotFormatError(f"{plan.path}: snapshot ends early ({self.size} bytes, needs {plan.end})")

    def read_chunk(self, c: ChunkRead) -> Optional[str]:
        chunk = checksum.ChunkSum(c.nbytes, algorithm=self.plan.algorithm)
        for p in c.pieces:
            self.read_piece(chunk, p)
        return self.plan.verdict(c, chunk.finish())

    def threads(self) -> int:
        """How many threads read the plan's chunks: this process's share of the cores
        (:func:`threads_here`, at most :attr:`workers_cap`), no more than there are chunks."""
        return max(1, min(threads_here(self.workers_cap), len(self.plan.chunks)))

    @abc.abstractmethod
    def read_piece(self, chunk: checksum.ChunkSum, p: PieceRead) -> None:
        """One CPU piece into its destination, added to ``chunk``'s sum."""

    def settle(self, after_copies: Optional[Callable[[], None]]) -> list[Optional[str]]:
        """After every chunk: ``after_copies()`` (if given), and the held-back verdicts (none here)."""
        if after_copies is not None:
            after_copies()
        return []

    def close(self) -> None:
        pass


class InPlaceReader(Reader):
    """CPU destinations without the native library: ``pread`` straight into the tensor, then summed."""

    def read_piece(self, chunk: checksum.ChunkSum, p: PieceRead) -> None:
        pread_into(self.fd, p.dst, p.file_offset)
        chunk.add(p.chunk_offset, p.dst)


class BlockReader(Reader):
    """CPU destinations, 4 KiB-page memory or disk (native library): ``pread`` in blocks of ``block``
    bytes into a per-thread buffer, copied into the tensor and summed in one pass."""

    def __init__(self, plan: ReadPlan, fd: int, block: int = READ_BLOCK):
        super().__init__(plan, fd)
        self.block = block
        self._buffers = threading.local()  # one read buffer per pool thread

    def read_piece(self, chunk: checksum.ChunkSum, p: PieceRead) -> None:
        part = p.dst.numpy()  # numpy: cheap slices
        if not hasattr(self._buffers, "block"):
            self._buffers.block = np.empty(self.block, np.uint8)
        for off in range(0, part.size, self.block):
            block = self._buffers.block[: min(self.block, part.size - off)]
            pread_into(self.fd, block, p.file_offset + off)
            chunk.copy_to(p.chunk_offset + off, part[off: off + block.size], block)


class MappedReader(Reader):
    """CPU destinations, a slot on a huge-page tmpfs (native library): copied from a read-only mapping of
    the whole container and summed in one pass (the size checked first, as by every reader: here reading
    past the mapping's end would be SIGBUS, not an error); an ``OSError`` from the mapping itself is the
    caller's to fall back on."""

    def __init__(self, plan: ReadPlan, fd: int):
        super().__init__(plan, fd)
        self._mapping = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self.src: Optional[np.ndarray] = np.frombuffer(self._mapping, np.uint8)

    def read_piece(self, chunk: checksum.ChunkSum, p: PieceRead) -> None:
        part = p.dst.numpy()
        chunk.copy_to(p.chunk_offset, part, self.src[p.file_offset: p.file_offset + part.size])

    def close(self) -> None:
        self.src = None  # (no view of the mapping may outlive it)
        self._mapping.close()


class DeviceReader(Reader):
    """GPU destinations (CUDA only). A chunk with a piece on a device, under the lanes checksum: its
    device pieces' copies queued - straight from the container page-locked in this process
    (``locked``), else through the stagings' pinned blocks, filled from ``cpu``'s mapping or by
    ``pread`` - and summed on the device, its host pieces read and summed on the host; the lanes combined
    in :meth:`settle`, after every copy has landed. A chunk of an older checksum: every piece read and
    summed on the host, device pieces copied after. A chunk with no device piece: ``cpu``'s.
    ``marks`` (the container's) get ``queued`` / ``landed``: when every copy was queued / had landed."""

    workers_cap = MAX_GPU_HOST_THREADS

    def __init__(self, plan: ReadPlan, fd: int, cpu: Reader, devices: list,
                 locked: Optional["device_staging.PageLockedFile"], marks: dict):
        super().__init__(plan, fd)
        self.cpu, self.marks, self.locked = cpu, marks, locked
        self.src = getattr(cpu, "src", None)
        # made on the caller's thread: see RestoreStagings' ordering rule
        self.stagings = device_staging.RestoreStagings(GPU_READ_BLOCK, devices)
        self.page_locked = torch.from_numpy(locked.array) if locked is not None else None
        self.on_device_sums = plan.algorithm == checksum.ALGORITHM
        self.later: dict[int, list] = {}  # chunk -> [(offset in the chunk, lanes or a _Landed)], for settle()
        self._finished = False

    def read_chunk(self, c: ChunkRead) -> Optional[str]:
        on_device = [device_staging.on_device(p.dst) for p in c.pieces]
        if not any(on_device):
            return self.cpu.read_chunk(c)
        if self.on_device_sums:
            parts = []
            for p, dev in zip(c.pieces, on_device):
                if dev:
                    parts.append((p.chunk_offset, self._upload(p)))
                else:
                    pread_into(self.fd, p.dst, p.file_offset)
                    parts.append((p.chunk_offset, checksum.host_lanes(p.dst)))
            self.later[c.index] = parts
            return None
        chunk = checksum.ChunkSum(c.nbytes, algorithm=self.plan.algorithm)
        for p, dev in zip(c.pieces, on_device):
            if dev:  # an older checksum: read and summed on the host, then copied
                part = torch.empty(p.nbytes, dtype=torch.uint8)
                pread_into(self.fd, part, p.file_offset)
                chunk.add(p.chunk_offset, part)
                p.dst.copy_(part)
            else:
                self.read_piece(chunk, p)
        return self.plan.verdict(c, chunk.finish())

    def read_piece(self, chunk: checksum.ChunkSum, p: PieceRead) -> None:
        self.cpu.read_piece(chunk, p)

    def threads(self) -> int:
        """Straight from a page-locked slot a thread only queues copies: one is enough (and no pool)."""
        return 1 if self.page_locked is not None else super().threads()

    def _upload(self, p: PieceRead):
        """A device piece's copies queued; its lanes (summed as it lands), or a :class:`_Landed` to sum
        with the other pieces copied straight from the page-locked slot, after every copy."""
        stage = self.stagings.here(p.dst.device)
        part, at = p.dst, p.file_offset
        if self.locked is not None and self.locked.wait_range(at, at + part.numel()):
            for lo, hi in self.locked.pieces(at, at + part.numel()):  # each copy inside one page-locked range
                stage.upload_page_locked(self.page_locked[lo:hi], part[lo - at: hi - at])
            return _Landed(part)
        for off in range(0, part.numel(), GPU_READ_BLOCK):
            k, block = stage.block()
            n = min(GPU_READ_BLOCK, part.numel() - off)
            if self.src is not None:
                np.copyto(block[:n].numpy(), self.src[at + off: at + off + n])
            else:
                pread_into(self.fd, block[:n], at + off)
            stage.upload(k, part[off: off + n])
        return stage.lanes(part)

    def settle(self, after_copies: Optional[Callable[[], None]]) -> list[Optional[str]]:
        self.marks["queued"] = time.perf_counter()
        landed = [x for parts in self.later.values() for _, x in parts if isinstance(x, _Landed)]
        with self.stagings.after_copies():  # launched while the copies are in flight
            sum_landed(landed)
            if after_copies is not None:
                after_copies()
        self._finish()
        later = sorted(self.later.items())  # the device lanes to the host in one copy, then combined
        device_parts = [lanes for _, parts in later for _, lanes in parts if not isinstance(lanes, list)]
        lanes = [x.lanes if isinstance(x, _Landed) else x for x in device_parts]
        on_host = iter(torch.stack(lanes).cpu().tolist() if lanes else [])
        out: list[Optional[str]] = []
        for i, parts in later:
            c = self.plan.chunks[i]
            host = [(off, lanes if isinstance(lanes, list) else next(on_host)) for off, lanes in parts]
            out.append(self.plan.verdict(c, checksum.combine_lanes(c.nbytes, host)))
        return out

    def _finish(self) -> None:
        if not self._finished:
            self._finished = True
            self.stagings.finish()  # every device copy done before the blocks or the mapping go
            self.marks["landed"] = time.perf_counter()

    def close(self) -> None:
        try:
            self._finish()
        finally:
            self.cpu.close()


class _Landed:
    """GPU path: a piece copied straight from a page-locked slot into ``part`` (device bytes); its
    ``lanes`` are summed after every copy has landed, with the restore's other such pieces in one launch."""
    __slots__ = ("part", "lanes")

    def __init__(self, part: torch.Tensor):
        self.part, self.lanes = part, None


def sum_landed(landed: list[_Landed]) -> None:
    """Fill in the lanes of ``landed`` pieces (their copies complete), one batched call per device."""
    by_device: dict[torch.device, list[_Landed]] = {}
    for x in landed:
        by_device.setdefault(x.part.device, []).append(x)
    for device, xs in by_device.items():
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            out = torch.empty(len(xs), 16, dtype=torch.int64, device=device)
            checksum.pieces_lanes([x.part for x in xs], out)
        for x, row in zip(xs, out):
            x.lanes = row


def pread_into(fd: int, dst: torch.Tensor | np.ndarray, offset: int) -> None:
    """Fill the contiguous CPU uint8 tensor or array ``dst`` from ``fd`` at ``offset`` (releases the GIL);
    a file that ends first is a :class:`~megatron_ft.capture.snapfile.SnapshotFormatError`."""
    arr = dst.numpy() if isinstance(dst, torch.Tensor) else dst
    n = arr.size
    if not n:
        return
    mv = memoryview(arr).cast("B")
    done = 0
    while done < n:
        got = os.preadv(fd, [mv[done: min(n, done + _PREAD_BLOCK)]], offset + done)
        if got <= 0:
            raise snapfile.SnapshotFormatError(f"snapshot ends early: {n - done} bytes missing at offset {offset + done}")
        done += got


# ------------------------------------------------------------------------------------ choosing, running
def cpu_reader(plan: ReadPlan, fd: int, mapped: bool) -> Reader:
    """The reader for the plan's CPU destinations: the mapping where ``mapped`` (a huge-page slot; a
    mapping that fails is said and read with ``pread``), else blocks (native library) or in place."""
    if mapped:
        try:
            return MappedReader(plan, fd)
        except OSError as e:  # not the snapshot's fault (e.g. address space): read it with pread
            log.warning("%s: mapping failed (%s); reading with pread", plan.path, e)
    return BlockReader(plan, fd, READ_BLOCK) if STREAMING_RESTORE else InPlaceReader(plan, fd)


def choose_reader(plan: ReadPlan, fd: int, mapped: bool, page_locked: Callable[[torch.device], object],
                  marks: dict) -> Reader:
    """Once per restore, on the caller's thread: the :class:`DeviceReader` where a destination is on a
    device (``page_locked(device)``: the container page-locked for it, or None), else :func:`cpu_reader`."""
    cpu = cpu_reader(plan, fd, mapped)
    devices = device_staging.devices_of(_destinations(plan))
    if not devices:
        return cpu
    locked = page_locked(devices[0]) if plan.algorithm == checksum.ALGORITHM else None
    return DeviceReader(plan, fd, cpu, devices, locked, marks)


def _destinations(plan: ReadPlan) -> Iterable[torch.Tensor]:
    return (p.dst for c in plan.chunks for p in c.pieces)


def read_verified(plan: ReadPlan, reader: Reader, after_copies: Optional[Callable[[], None]] = None) -> None:
    """Run ``plan`` with ``reader`` (closed here, whatever happens): every chunk on the pool's threads,
    then :meth:`Reader.settle` with ``after_copies`` - skipped when a chunk already failed on the host.
    Raises :class:`~megatron_ft.capture.snapfile.SnapshotFormatError` naming the first bad chunk."""
    chunks, workers = plan.chunks, reader.threads()
    try:
        if workers == 1:
            errors = [reader.read_chunk(c) for c in chunks]
        else:  # (each RestoreStaging makes its device current for its CUDA calls: a pool thread's is 0)
            with ThreadPoolExecutor(workers, thread_name_prefix="mft-restore") as pool:
                errors = list(pool.map(reader.read_chunk, chunks))
        errors += reader.settle(after_copies if not any(errors) else None)
    finally:
        reader.close()
    bad = [e for e in errors if e]
    if bad:
        raise snapfile.SnapshotFormatError(bad[0] + (f" (and {len(bad) - 1} more chunks)" if len(bad) > 1 else ""))
