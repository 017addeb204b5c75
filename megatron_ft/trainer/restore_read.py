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
``ChunkMappedReader``  CPU tensors from a slot on a 4 KiB-page tmpfs (native library), read on one thread:
                       each chunk's bytes mapped read-only and populated in one call (``MADV_POPULATE_READ``),
                       copied, summed and screened in one native call, and unmapped (a ``pread`` costs ~0.7 us
                       of kernel time per 4 KiB page on the 2-core test machine, mapping + populating +
                       unmapping ~0.35 us). On several threads as ``BlockReader`` (the threads of one process
                       serialize on its mapping lock).
``MappedReader``       CPU tensors from a slot on a huge-page tmpfs (native library): the whole container
                       mapped read-only once (one page-table entry per 2 MiB), each chunk copied, summed and
                       screened in one native call.
``BlockReader``        CPU tensors from disk (native library), and a chunk a mapping failed for: a chunk
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
chunk in one call (``mft_f8_restore_chunk``: the three native CPU readers, a plan whose destinations
are all in host memory, the current checksum), it also checks every floating-point piece (float32/64/16,
bfloat16) for NaN and infinities while the bytes are in registers - what the value guard
(:class:`~megatron_ft.trainer.guard.ValueScreen`) would otherwise read again after the restore
(17-19 ms for 256 MiB x 2 ranks on the test machine, a third of the read). The restore has the guard
read only what was not screened in the pass (other dtypes, device tensors, a chunk read piece by piece).

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

import ctypes
import errno
import logging
import mmap
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Optional

import numpy as np
import torch

from ..capture import checksum, snapfile
from . import device_staging
from .restore_device import DeviceReader
from .restore_plan import (EXPONENT_MASKS, GPU_READ_BLOCK, MAX_GPU_HOST_THREADS, MAX_RESTORE_THREADS, READ_BLOCK,
                           ChunkRead, PieceRead, ReadPlan, Reader, byte_view, plan_reads, pread_into,
                           restore_threads, threads_here)

__all__ = [  # the plan's names are this module's too: callers import a restore's reading from here
    "MAX_RESTORE_THREADS", "MAX_GPU_HOST_THREADS", "READ_BLOCK", "GPU_READ_BLOCK", "EXPONENT_MASKS",
    "restore_threads", "threads_here", "PieceRead", "ChunkRead", "ReadPlan", "byte_view", "plan_reads",
    "Reader", "pread_into", "DeviceReader", "STREAMING_RESTORE", "HUGE_TMPFS", "TMPFS", "FILE",
    "InPlaceReader", "BlockReader", "MappedReader", "ChunkMappedReader", "cpu_reader", "choose_reader",
    "read_verified",
]

log = logging.getLogger("megatron_ft.trainer.restore_read")

STREAMING_RESTORE = checksum.HAVE_NATIVE
#: where a container lives (:func:`cpu_reader` picks the reader by it): a tmpfs with 2 MiB pages, a tmpfs
#: with 4 KiB pages, anything else (a file on disk)
HUGE_TMPFS, TMPFS, FILE = "huge-tmpfs", "tmpfs", "file"
#: ``madvise`` advice: populate the page tables of a mapping for reading (Linux 5.14+; EINVAL before)
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_POPULATE = {"usable": hasattr(mmap.mmap, "madvise")}

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
    """CPU destinations, disk (native library), and a chunk a mapping failed for: ``pread`` in blocks of
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
    ``[lo, hi)``, the range a reader maps."""

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


class MappedReader(Reader):
    """CPU destinations, a slot on a huge-page tmpfs (native library): each chunk copied from a read-only
    mapping of the whole container, summed and screened in one native pass (the size checked first, as by
    every reader: here reading past the mapping's end would be SIGBUS, not an error); an ``OSError`` from
    the mapping itself is the caller's to fall back on."""

    def __init__(self, plan: ReadPlan, fd: int):
        super().__init__(plan, fd)
        self._mapping = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self.src: Optional[np.ndarray] = np.frombuffer(self._mapping, np.uint8)
        self._fused = _fused_pieces(plan)

    def read_chunk(self, c: ChunkRead) -> Optional[str]:
        if self._fused is None or self.src is None:
            return super().read_chunk(c)
        return self.plan.verdict(c, self._fused.run(c, self.src.ctypes.data))

    def read_piece(self, chunk: checksum.ChunkSum, p: PieceRead) -> None:
        part = p.dst.numpy()
        chunk.copy_to(p.chunk_offset, part, self.src[p.file_offset: p.file_offset + part.size])

    def screened(self) -> dict[str, bool]:
        return self._fused.screened() if self._fused is not None else {}

    def close(self) -> None:
        self.src = None  # (no view of the mapping may outlive it)
        self._mapping.close()


class ChunkMappedReader(BlockReader):
    """CPU destinations, a slot on a 4 KiB-page tmpfs (native library): per chunk, the container range it
    reads mapped read-only, its page tables populated in one call (``MADV_POPULATE_READ``), the chunk
    copied, summed and screened in one native pass, and the range unmapped. The size was checked first
    (as by every reader); a range that cannot be mapped or populated (address space, memory; a kernel
    without ``MADV_POPULATE_READ`` faults it in as it is read) is read with ``pread`` instead
    (:class:`BlockReader`, which also reads the pieces a :class:`DeviceReader` hands it).

    Only where the read runs on one thread (``map_chunks`` None: :meth:`threads` is 1, e.g. two ranks
    on two cores): the threads of one process serialize on its mapping lock when they map and unmap,
    and there the ``pread`` blocks were faster (one rank, two threads, 256 MiB: 30-33 ms against 38-48 ms
    mapped). On one thread per rank, two ranks, 256 MiB each: 46-54 ms mapped against 48-57 ms with
    ``pread`` - of which populating 16-18 ms, copying + summing + screening 21-23 ms, unmapping 5 ms."""

    def __init__(self, plan: ReadPlan, fd: int, block: int = READ_BLOCK, map_chunks: Optional[bool] = None):
        super().__init__(plan, fd, block)
        self.map_chunks = self.threads() == 1 if map_chunks is None else map_chunks
        self._said = False  # (a chunk read with pread instead: said once)

    def _with_pread(self, c: ChunkRead, what: str, e: OSError) -> Optional[str]:
        if not self._said:
            self._said = True
            log.warning("%s: %s chunk %d failed (%s); reading it, and any other such chunk, with pread",
                        self.plan.path, what, c.index, e)
        return super().read_chunk(c)

    def read_chunk(self, c: ChunkRead) -> Optional[str]:
        if self._fused is None or not self.map_chunks:
            return super().read_chunk(c)
        lo, hi = self._fused.range[c.index]
        if hi <= lo:  # no bytes to read
            return self.plan.verdict(c, self._fused.run(c, 0))
        start = lo - lo % mmap.ALLOCATIONGRANULARITY
        try:
            mapping = mmap.mmap(self.fd, hi - start, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=start)
        except OSError as e:  # not the snapshot's fault (e.g. address space): read it with pread
            return self._with_pread(c, "mapping", e)
        try:
            if _POPULATE["usable"]:
                try:
                    mapping.madvise(MADV_POPULATE_READ)
                except OSError as e:
                    if e.errno != errno.EINVAL:  # (EINVAL: a kernel before 5.14, faulted in as read)
                        return self._with_pread(c, "populating", e)
                    _POPULATE["usable"] = False
            view = np.frombuffer(mapping, np.uint8)
            try:
                got = self._fused.run(c, view.ctypes.data - start)
            finally:
                del view  # (no view of the mapping may outlive it)
        finally:
            mapping.close()
        return self.plan.verdict(c, got)


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
def cpu_reader(plan: ReadPlan, fd: int, medium: str) -> Reader:
    """The reader for the plan's CPU destinations by the container's ``medium``: a huge-page tmpfs
    (:data:`HUGE_TMPFS`) mapped whole - one page-table entry per 2 MiB, the bytes straight from the slot (a
    mapping that fails is said and read with ``pread``); a 4 KiB-page tmpfs (:data:`TMPFS`) mapped chunk by
    chunk (``pread`` costs more kernel time per 4 KiB page there than mapping, populating and unmapping it);
    else (:data:`FILE`) blocks - each with the native library; without it in place."""
    if medium == HUGE_TMPFS and STREAMING_RESTORE:
        try:
            return MappedReader(plan, fd)
        except OSError as e:  # not the snapshot's fault (e.g. address space): read it with pread
            log.warning("%s: mapping failed (%s); reading with pread", plan.path, e)
    if medium == TMPFS and STREAMING_RESTORE and _RESTORE_CHUNK is not None:
        return ChunkMappedReader(plan, fd, READ_BLOCK)
    return BlockReader(plan, fd, READ_BLOCK) if STREAMING_RESTORE else InPlaceReader(plan, fd)


def choose_reader(plan: ReadPlan, fd: int, medium: str, page_locked: Callable[[torch.device], object],
                  marks: dict) -> Reader:
    """Once per restore, on the caller's thread: the :class:`DeviceReader` where a destination is on a
    device (``page_locked(device)``: the container page-locked for it, or None), else :func:`cpu_reader`."""
    cpu = cpu_reader(plan, fd, medium)
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
