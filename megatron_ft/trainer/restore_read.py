"""Reading a snapshot container back into the tensors it restores: a read plan, one reader per medium.

A restore moves every tensor of a container (a node agent's shared-memory slot, or a persisted file)
into the tensor it restores and verifies each chunk's checksum in the same pass. The work is split the
way ``torch.distributed.checkpoint`` splits a load - plan the reads, then read them:

* :func:`plan_reads` (pure, no byte moves): for every chunk of the layout, the byte ranges of the
  container it holds, the destination bytes each goes to, and the sum the chunk must have;
* :func:`choose_reader`: once per restore, the :class:`Reader` for the medium the bytes come from
  (:data:`HUGE_TMPFS`, :data:`TMPFS`, :data:`FILE`) and go to;
* :func:`read_verified`: the plan run with that reader over the idle cores (:func:`threads_here`; the
  reads and sums release the GIL). After every chunk was read it raises
  :class:`~megatron_ft.capture.snapfile.SnapshotFormatError` naming the first bad chunk (and how many
  more); the destinations may then hold part of the snapshot (the caller handles that).

The readers. On the same containers - whole, truncated, corrupted - every one gives the same verdicts
and bytes (``tests/unit/test_restore_read.py`` runs each over them):

=====================  ======================================================================================
reader                 reads
=====================  ======================================================================================
``MappedReader``       CPU tensors from a slot on a tmpfs (native library), through the process's mapping of
                       the slot (:mod:`.mapped_slots`): the one its snapshot engine writes through (an
                       in-process restart, a rollback: no page-table work), else mapped, populated and left to
                       the engine (a fresh process; before, the restore mapped and unmapped it and the engine
                       mapped it again: on a 4 KiB-page tmpfs populating 256 MiB took 16-24 ms, unmapping
                       8-13 ms, copying 19 ms). Each chunk copied, summed and screened in one native call,
                       on the idle cores (a populated mapping takes no faults to serialize on).
``BlockReader``        CPU tensors from disk (native library), and a slot the mapping failed for: a chunk
                       ``pread`` whole into a per-thread buffer of :data:`READ_BLOCK`, then copied into the
                       tensors, summed and screened in one native call (streaming stores: the tensors' lines
                       are not read first); a chunk larger than the buffer in blocks, piece by piece.
``InPlaceReader``      CPU tensors without the native library: ``pread`` straight into the tensor, then summed
                       (numpy).
``DeviceReader``       GPU tensors (CUDA only; its bookkeeping tested on CPU with stubs,
                       ``tests/integration/test_gpu_path_logic.py``): copies queued from a page-locked slot, or
                       through pinned blocks, summed on the device once they have landed; the restore's CPU
                       tensors through the CPU reader it wraps.
=====================  ======================================================================================

*Screened in the pass* (:meth:`Reader.screened`): where the native library copies and sums a whole
chunk in one call (``mft_f8_restore_chunk``: the two native CPU readers, a plan whose destinations
are all in host memory, the current checksum), it also checks every floating-point piece (float32/64/16,
bfloat16) for NaN and infinities while the bytes are in registers - what the value guard
(:class:`~megatron_ft.trainer.guard.ValueScreen`) would otherwise read again after the restore
(17-19 ms for 256 MiB x 2 ranks on the test machine, a third of the read). The restore has the guard
read only what was not screened in the pass (other dtypes, device tensors, a chunk read piece by piece).

Ownership: the plan holds views of the caller's tensors (it owns no memory); a reader owns what it
opened (pinned blocks, device streams) until :meth:`Reader.close` - a slot's mapping is the process's
(:mod:`.mapped_slots`), not the reader's - which
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

import ctypes
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Optional

import numpy as np
import torch

from ..capture import checksum, snapfile
from ..agent import shm
from . import device_staging, mapped_slots
from .restore_device import DeviceReader
from .restore_plan import (EXPONENT_MASKS, GPU_READ_BLOCK, MAX_GPU_HOST_THREADS, MAX_RESTORE_THREADS, READ_BLOCK,
                           ChunkRead, PieceRead, ReadPlan, Reader, byte_view, plan_reads, pread_into,
                           restore_threads, threads_here)

__all__ = [  # the plan's names are this module's too: callers import a restore's reading from here
    "MAX_RESTORE_THREADS", "MAX_GPU_HOST_THREADS", "READ_BLOCK", "GPU_READ_BLOCK", "EXPONENT_MASKS",
    "restore_threads", "threads_here", "PieceRead", "ChunkRead", "ReadPlan", "byte_view", "plan_reads",
    "Reader", "pread_into", "DeviceReader", "STREAMING_RESTORE", "HUGE_TMPFS", "TMPFS", "FILE",
    "InPlaceReader", "BlockReader", "MappedReader", "maps", "cpu_reader", "choose_reader",
    "read_verified",
]

log = logging.getLogger("megatron_ft.trainer.restore_read")

STREAMING_RESTORE = checksum.HAVE_NATIVE
#: where a container lives (:func:`cpu_reader` picks the reader by it): a tmpfs with 2 MiB pages, a tmpfs
#: with 4 KiB pages, anything else (a file on disk)
HUGE_TMPFS, TMPFS, FILE = "huge-tmpfs", "tmpfs", "file"

def _native_restore_chunk() -> Optional[Callable[..., int]]:
    """``mft_f8_restore_chunk`` of the native library (``_native/fastcopy.c``), or None (not built, or a
    build older than that function: the mapped readers then go piece by piece, and nothing is screened)."""
    lib = getattr(checksum, "_LIB", None)
    fn = getattr(lib, "mft_f8_restore_chunk", None) if lib is not None else None
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_uint64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_uint64
    return fn


_RESTORE_CHUNK = _native_restore_chunk()



class InPlaceReader(Reader):
    """CPU destinations without the native library: ``pread`` straight into the tensor, then summed."""

    def read_piece(self, chunk: checksum.ChunkSum, p: PieceRead) -> None:
        pread_into(self.fd, p.dst, p.file_offset)
        chunk.add(p.chunk_offset, p.dst)


class BlockReader(Reader):
    """CPU destinations, disk (native library), and a slot the mapping failed for: ``pread`` in blocks of
    ``block`` bytes into a per-thread buffer, copied into the tensor and summed in one pass. A chunk whose
    bytes fit in one block (the default chunk, 4 MiB, is one) is read with one ``pread`` and copied,
    summed and screened in one native call (:class:`_FusedPieces`); a larger one piece by piece."""

    def __init__(self, plan: ReadPlan, fd: int, block: int = READ_BLOCK):
        super().__init__(plan, fd)
        self.block = block
        self._buffers = threading.local()  # one read buffer per pool thread
        self._fused = _fused_pieces(plan)

    def _buffer(self) -> np.ndarray:
        if not hasattr(self._buffers, "block"):
            self._buffers.block = np.empty(self.block, np.uint8)
        return self._buffers.block

    def read_chunk(self, c: ChunkRead) -> Optional[str]:
        if self._fused is None:
            return super().read_chunk(c)
        lo, hi = self._fused.range[c.index]
        if hi - lo > self.block:
            return super().read_chunk(c)
        buf = self._buffer()
        pread_into(self.fd, buf[: hi - lo], lo)
        return self.plan.verdict(c, self._fused.run(c, buf.ctypes.data - lo))

    def read_piece(self, chunk: checksum.ChunkSum, p: PieceRead) -> None:
        part = p.dst.numpy()  # numpy: cheap slices
        buffer = self._buffer()
        for off in range(0, part.size, self.block):
            block = buffer[: min(self.block, part.size - off)]
            pread_into(self.fd, block, p.file_offset + off)
            chunk.copy_to(p.chunk_offset + off, part[off: off + block.size], block)

    def screened(self) -> dict[str, bool]:
        return self._fused.screened() if self._fused is not None else {}


class _FusedPieces:
    """A plan's pieces as the arrays ``mft_f8_restore_chunk`` reads, one slice per chunk, and what it
    said of each: whether a piece went through it (``done``) and whether it held a NaN or an infinity
    (``bad``). Made on the caller's thread; each chunk's slice is then written by one pool thread only.
    The pieces are checked here as ``ChunkSum`` checks them (in order, 32-byte aligned, inside their
    chunk; a ``ValueError`` otherwise), and each chunk's source bytes to lie inside its container range
    ``[lo, hi)``, the range a reader reads for it (one ``pread`` of it whole, or the mapping's)."""

    def __init__(self, plan: ReadPlan):
        pieces = [p for c in plan.chunks for p in c.pieces]
        self.names = [p.name for p in pieces]
        self.chunk_off = np.array([p.chunk_offset for p in pieces], np.uint64)
        self.nbytes = np.array([p.nbytes for p in pieces], np.uint64)
        self.dst = np.array([p.dst.data_ptr() if p.nbytes else 0 for p in pieces], np.uint64)
        self.src = np.array([p.file_offset for p in pieces], np.uint64)
        self.mask = np.array([p.screen for p in pieces], np.uint64)
        self.bad = np.zeros(len(pieces), np.uint64)
        self.done = np.zeros(len(pieces), np.bool_)
        self.start: dict[int, tuple[int, int]] = {}  # chunk index -> its pieces' slice
        self.range: dict[int, tuple[int, int]] = {}  # chunk index -> [lo, hi) of the container it reads
        at = 0
        for c in plan.chunks:
            pos, lo, hi = 0, None, None
            for p in c.pieces:
                if p.chunk_offset < pos or p.chunk_offset % 32 or p.chunk_offset + p.nbytes > c.nbytes:
                    raise ValueError(f"piece [{p.chunk_offset}, {p.chunk_offset + p.nbytes}) of a {c.nbytes}-byte "
                                     f"chunk is out of order, out of range or not 32-byte aligned")
                if p.dst.device.type != "cpu" or not p.dst.is_contiguous():
                    raise ValueError(f"{p.name}: the fused read takes contiguous CPU destinations")
                pos = p.chunk_offset + -(-p.nbytes // 32) * 32
                lo = p.file_offset if lo is None else min(lo, p.file_offset)
                hi = p.file_offset + p.nbytes if hi is None else max(hi, p.file_offset + p.nbytes)
            self.start[c.index] = (at, at + len(c.pieces))
            self.range[c.index] = (lo or 0, hi or 0)
            at += len(c.pieces)

    def run(self, c: ChunkRead, base: int) -> int:
        """Chunk ``c``'s pieces copied from ``base + file_offset`` (the caller's mapping), summed and
        screened in one native call (releases the GIL); its digest."""
        a, b = self.start[c.index]
        word = 8  # bytes of a uint64: the arrays' element
        got = _RESTORE_CHUNK(c.nbytes, b - a, self.chunk_off.ctypes.data + a * word, self.nbytes.ctypes.data + a * word,
                             self.dst.ctypes.data + a * word, base % (1 << 64), self.src.ctypes.data + a * word,
                             self.mask.ctypes.data + a * word, self.bad.ctypes.data + a * word)
        self.done[a:b] = True
        return int(got)

    def screened(self) -> dict[str, bool]:
        finite: dict[str, bool] = {}
        whole: dict[str, bool] = {}
        for i, name in enumerate(self.names):
            whole[name] = whole.get(name, True) and bool(self.done[i]) and bool(self.mask[i])
            finite[name] = finite.get(name, True) and not self.bad[i]
        return {n: finite[n] for n, ok in whole.items() if ok}


class MappedReader(BlockReader):
    """CPU destinations, a slot on a tmpfs (native library), read through the process's mapping of it
    (:mod:`.mapped_slots`: the one the snapshot engine writes through, or mapped and populated here once
    and left to the engine): each chunk copied, summed and screened in one native pass, with no page-table
    work when the mapping was there already. The mapping is taken at the first chunk read (a plan whose
    pieces all go to a device never maps the slot); one that fails (address space, memory, a re-created
    file: not the snapshot's fault) is said once and the slot read with ``pread`` (:class:`BlockReader`).
    The size was checked first, as by every reader (reading past the mapping's end would be SIGBUS, not an
    error). The mapping is not this reader's to close."""

    def __init__(self, plan: ReadPlan, fd: int, block: int = READ_BLOCK):
        super().__init__(plan, fd, block)
        self._src: Optional[np.ndarray] = None
        self._mapping_failed = False
        self._lock = threading.Lock()

    def _mapped(self) -> Optional[np.ndarray]:
        """The slot's bytes as the process maps them, or None (read with ``pread``)."""
        with self._lock:
            if self._src is None and not self._mapping_failed:
                try:
                    mapping = mapped_slots.slot_mapping(self.plan.path, self.fd)
                    if mapping.size != self.size:
                        raise OSError(f"a mapping of {mapping.size} bytes for a {self.size}-byte container")
                    self._src = mapping.array
                except (OSError, shm.SharedMemoryError) as e:
                    self._mapping_failed = True
                    log.warning("%s: mapping failed (%s); reading with pread", self.plan.path, e)
            return self._src

    def read_chunk(self, c: ChunkRead) -> Optional[str]:
        src = self._mapped() if self._fused is not None else None
        if src is None:
            return super().read_chunk(c)
        return self.plan.verdict(c, self._fused.run(c, src.ctypes.data))

    def read_piece(self, chunk: checksum.ChunkSum, p: PieceRead) -> None:
        src = self._mapped()
        if src is None:
            return super().read_piece(chunk, p)
        part = p.dst.numpy()
        chunk.copy_to(p.chunk_offset, part, src[p.file_offset: p.file_offset + part.size])

    def close(self) -> None:
        self._src = None  # (the process keeps the mapping; this reader's view of it goes)


def _fused_pieces(plan: ReadPlan) -> Optional[_FusedPieces]:
    """The plan's :class:`_FusedPieces` where the native fused call can read it: the library has it, the
    container's checksum is the one it sums, and every destination is in host memory (a plan with device
    destinations reads its CPU tensors' chunks through :class:`DeviceReader`, piece by piece)."""
    if _RESTORE_CHUNK is None or plan.algorithm != checksum.ALGORITHM or not _cpu_only(plan):
        return None
    return _FusedPieces(plan)


def _cpu_only(plan: ReadPlan) -> bool:
    """Whether every destination of ``plan`` is in host memory."""
    return all(p.dst.device.type == "cpu" for c in plan.chunks for p in c.pieces)


# ------------------------------------------------------------------------------------ choosing, running
def maps(medium: str) -> bool:
    """Whether a container on ``medium`` is read through the process's mapping of it (:class:`MappedReader`)."""
    return medium in (HUGE_TMPFS, TMPFS) and STREAMING_RESTORE and _RESTORE_CHUNK is not None


def cpu_reader(plan: ReadPlan, fd: int, medium: str) -> Reader:
    """The reader for the plan's CPU destinations by the container's ``medium``: a slot on a tmpfs
    (:data:`HUGE_TMPFS`, :data:`TMPFS`) read through the process's mapping of it (:class:`MappedReader`),
    else (:data:`FILE`) blocks - each with the
    native library; without it in place."""
    if maps(medium):
        return MappedReader(plan, fd, READ_BLOCK)
    return BlockReader(plan, fd, READ_BLOCK) if STREAMING_RESTORE else InPlaceReader(plan, fd)


def choose_reader(plan: ReadPlan, fd: int, medium: str, page_locked: Callable[[torch.device], object],
                  marks: dict) -> Reader:
    """Once per restore, on the caller's thread: the :class:`DeviceReader` where a destination is on a
    device (``page_locked(device)``: the container page-locked for it, or None), else :func:`cpu_reader`.
    The device reader's few CPU pieces (RNG states, counters) are read with ``pread``: mapping a whole slot
    for them would populate its page tables on the restore's path (a 16 GiB slot: about 4 M entries)."""
    devices = device_staging.devices_of(_destinations(plan))
    if not devices:
        return cpu_reader(plan, fd, medium)
    cpu = BlockReader(plan, fd, READ_BLOCK) if STREAMING_RESTORE else InPlaceReader(plan, fd)
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
