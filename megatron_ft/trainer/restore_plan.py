"""A restore's read plan and the reader interface (:mod:`.restore_read` has the readers, the choice of
one and the run of a plan; this module is their common ground: what to read, and the contract of a
reader).

* :func:`plan_reads` (pure, no byte moves): for every chunk of the layout, the byte ranges of the
  container it holds, the destination bytes each goes to, and the sum the chunk must have;
* :class:`Reader`: one medium's way of reading a plan's chunks into their destinations and summing them;
* :func:`restore_threads`, :func:`threads_here`: how many threads read (a rank's share of the cores);
* :func:`pread_into`: a destination filled from a file descriptor.

Ownership: the plan holds views of the caller's tensors (it owns no memory); a reader owns what it
opened (a mapping, pinned blocks, device streams) until :meth:`Reader.close`.
"""
from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from ..capture import checksum, snapfile
from ..capture.layout import Layout

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
_PREAD_BLOCK = 1 << 30
#: per floating-point dtype a snapshot holds (``capture.layout.ITEMSIZE``): its exponent bits in every
#: element of a 64-bit word (the native screen for NaN and infinities: an element whose exponent bits
#: are all set is one). Other dtypes (integers, bool) are not screened.
EXPONENT_MASKS = {torch.float32: 0x7F8000007F800000, torch.float64: 0x7FF0000000000000,
                  torch.float16: 0x7C007C007C007C00, torch.bfloat16: 0x7F807F807F807F80}



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
    to land in ``dst`` (a uint8 view of the destination: as many bytes); ``screen``: the destination
    dtype's :data:`EXPONENT_MASKS` entry (0: not a dtype screened in the pass)."""
    name: str
    file_offset: int
    chunk_offset: int
    dst: torch.Tensor
    screen: int = 0

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
    masks = [EXPONENT_MASKS.get(views[n].dtype, 0) for n in names]
    chunks = []
    for i, pieces in enumerate(layout.all_pieces()):
        lo, hi = layout.chunk_bounds(i)
        chunks.append(ChunkRead(i, hi - lo, sums[i], tuple(
            PieceRead(names[p.entry_index], data_off + p.dst_offset, p.dst_offset - lo,
                      flat[names[p.entry_index]][p.src_start:p.src_end], masks[p.entry_index]) for p in pieces)))
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

    def screened(self) -> dict[str, bool]:
        """After the read: the tensors screened for NaN and infinities in the pass - every piece of them
        read by the native fused pass - each with whether it holds only finite values (none here)."""
        return {}

    def close(self) -> None:
        pass


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


