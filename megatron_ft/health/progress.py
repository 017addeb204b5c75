"""Where each trainer is: one 64-byte record per rank in a shared-memory file its node agent owns.

The trainer writes its record (:class:`ProgressWriter`, on the training thread: three stores into a
mapping, no system call) whenever it enters a phase - its own work, a collective, a wait for its
agent, the restore, Megatron's own disk save - and at every iteration's end. The agent reads every
record each ``hang.tick_s`` (:func:`read`) and judges from them whether a rank hangs
(:mod:`.hang`). Nothing is sent: a trainer stopped, or one whose agent is paused, costs the other
side nothing, and a paused agent reads the truth when it runs again.

Format ``megatron-ft-progress`` version 1 (little-endian), file
``<agent.shm_dir>/mft.<run>.n<node>.progress``: ``ranks_per_node`` records of :data:`RECORD` bytes,
the record of local index ``rank % ranks_per_node`` at ``index * RECORD``:

====== ====== =========================================================================
offset type   field
====== ====== =========================================================================
0      u64    ``seq``: odd while the trainer writes the record, even when it is whole
8      i64    ``steps``: iterations this trainer (this attempt of it) has finished
16     u32    ``phase``: :data:`PHASES` index (start: from the process's start to its rendezvous)
20     u32    ``pid``: the trainer's process id
24     f64    ``since``: when the phase began (``CLOCK_MONOTONIC`` seconds: one clock per host)
32     f64    ``started``: when this trainer opened its record
40     f64    ``iter_s``: the last iteration's duration
48     f64    ``work_s``: of it, the time outside collectives and waits for the agent
56     u32    ``version`` (1)
60     u32    reserved
====== ====== =========================================================================

The seqlock keeps a reader from taking half of one write and half of another: the writer makes
``seq`` odd, writes the body, makes it even; the reader reads ``seq``, the body, ``seq`` again, and
keeps the body only when both were the same even number (else it retries, and a record torn for good -
its writer stopped in the middle of a write - reads as the last whole one this reader saw).

>>> import tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "p")
>>> board = ProgressBoard.create(path, ranks_per_node=2)
>>> w = ProgressWriter(path, index=1, now=lambda: 10.0)
>>> w.enter(WORK)
1
>>> w.step(iter_s=0.5, work_s=0.3)
>>> b = board.read(1)
>>> (PHASES[b.phase], b.steps, b.since, b.iter_s, b.work_s, b.pid == os.getpid())
('work', 1, 10.0, 0.5, 0.3, True)
>>> board.read(0) is None   # no trainer has written that record
True
>>> w.close(); board.close(unlink=True)
"""
from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from typing import Callable, Optional

FORMAT = "megatron-ft-progress"
VERSION = 1
RECORD = 64
_SEQ = struct.Struct("<Q")
_BODY = struct.Struct("<qIIddddII")  # every field after ``seq``, at offset 8
assert _SEQ.size + _BODY.size == RECORD

#: the phases a trainer reports, by index
#: ``done``: the training ended as the script meant it to; ``exiting``: the process ends on an error (a
#: crash, a lost peer): never judged hung either, but its node's training is not over
PHASES = ("none", "start", "work", "collective", "agent", "restore", "save", "done", "rendezvous", "exiting")
NONE, START, WORK, COLLECTIVE, AGENT, RESTORE, SAVE, DONE, RENDEZVOUS, EXITING = range(len(PHASES))
#: phases in which a rank waits for others (never the one to blame for a stall)
WAITING = frozenset({COLLECTIVE, AGENT, RENDEZVOUS})
#: the environment variable that names a trainer's progress file (``megatron-ft launch`` sets it)
ENV = "MFT_PROGRESS_FILE"


def board_path(shm_dir: str, run_id: str, node: int) -> str:
    """The node's progress file (a name no slot or block segment can have)."""
    return os.path.join(shm_dir, f"mft.{run_id}.n{node}.progress")


@dataclass(frozen=True)
class Progress:
    """One rank's record as read (see the module's table)."""

    seq: int
    steps: int
    phase: int
    pid: int
    since: float
    started: float
    iter_s: float
    work_s: float

    @property
    def phase_name(self) -> str:
        return PHASES[self.phase] if 0 <= self.phase < len(PHASES) else f"phase{self.phase}"


def _map(path: str, size: int, create: bool) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
    try:
        if create and os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
        elif os.fstat(fd).st_size < size:
            raise ValueError(f"progress file {path} holds {os.fstat(fd).st_size} bytes, fewer than {size}")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class ProgressBoard:
    """The agent's side: creates (or, for an agent that adopts its predecessor's trainers, re-opens) the
    file and reads records. Owns the file: :meth:`close` with ``unlink`` removes it."""

    def __init__(self, path: str, ranks_per_node: int, mm: mmap.mmap):
        self.path, self.ranks_per_node, self.mm = path, ranks_per_node, mm
        self._whole: dict[int, Progress] = {}  # index -> the last whole record read

    @classmethod
    def create(cls, path: str, ranks_per_node: int) -> "ProgressBoard":
        return cls(path, ranks_per_node, _map(path, ranks_per_node * RECORD, create=True))

    def read(self, index: int, tries: int = 100) -> Optional[Progress]:
        """Record ``index`` whole, or None where no trainer has written one. Torn ``tries`` times running
        (its writer stopped in the middle of a write): the last whole record this board read of it."""
        off = index * RECORD
        for _ in range(tries):
            first = _SEQ.unpack_from(self.mm, off)[0]
            body = _BODY.unpack_from(self.mm, off + _SEQ.size)
            if first % 2 == 0 and _SEQ.unpack_from(self.mm, off)[0] == first:
                break
        else:
            return self._whole.get(index)
        steps, phase, pid, since, started, iter_s, work_s, version, _ = body
        if version != VERSION or pid == 0:
            return None
        self._whole[index] = p = Progress(first, steps, phase, pid, since, started, iter_s, work_s)
        return p

    def close(self, unlink: bool = False) -> None:
        try:
            self.mm.close()
        except (BufferError, ValueError):
            pass
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class ProgressWriter:
    """The trainer's side: its record at ``index``. Single writer (the training thread); every call
    is a few stores into the mapping. ``now``: the clock (``time.monotonic``, the agent's too)."""

    def __init__(self, path: str, index: int, now: Callable[[], float] = time.monotonic):
        self.mm = _map(path, (index + 1) * RECORD, create=False)
        self.off, self.now = index * RECORD, now
        self.seq = _SEQ.unpack_from(self.mm, self.off)[0] & ~1
        self.steps, self.phase, self.pid = 0, START, os.getpid()
        self.started = self.since = now()
        self.iter_s = self.work_s = 0.0
        self._write()

    def _write(self) -> None:
        self.seq += 1
        _SEQ.pack_into(self.mm, self.off, self.seq)  # odd: a write under way
        _BODY.pack_into(self.mm, self.off + _SEQ.size, self.steps, self.phase, self.pid, self.since, self.started,
                        self.iter_s, self.work_s, VERSION, 0)
        self.seq += 1
        _SEQ.pack_into(self.mm, self.off, self.seq)  # even: whole

    def enter(self, phase: int) -> int:
        """Enter ``phase``; returns the phase left."""
        left, self.phase, self.since = self.phase, phase, self.now()
        self._write()
        return left

    def step(self, iter_s: float, work_s: float) -> None:
        """An iteration finished in ``iter_s`` seconds, ``work_s`` of them the rank's own work; the next
        begins in :data:`WORK`."""
        self.steps += 1
        self.iter_s, self.work_s = iter_s, work_s
        self.phase, self.since = WORK, self.now()
        self._write()

    def close(self) -> None:
        try:
            self.mm.close()
        except (BufferError, ValueError):
            pass


_process_writer: Optional[tuple[int, str, int, ProgressWriter]] = None


def writer_for_process(path: str, index: int) -> Optional[ProgressWriter]:
    """This process's writer of record ``index`` of ``path`` (one per process: a forked trainer's first
    call opens its own, in :data:`START`); None where the file is not there (no agent made it). Its first
    call in a process also has SIGUSR1 write every thread's stack to stderr (:func:`stacks_on_sigusr1`)."""
    global _process_writer
    w = _process_writer
    if w is not None and w[0] == os.getpid() and w[1:3] == (path, index):
        return w[3]
    stacks_on_sigusr1()
    try:
        writer = ProgressWriter(path, index)
    except (OSError, ValueError):
        return None
    _process_writer = (os.getpid(), path, index, writer)
    return writer


def stacks_on_sigusr1() -> None:
    """SIGUSR1 first writes every thread's stack of this process to its stderr (a trainer's log), then does
    what it did before (chained: by default the process ends, as SIGUSR1 ends it; a handler the script
    installs later replaces this one): what a stuck trainer was doing, for whoever looks - the demo asks
    every process of a job that outlived its bound before it kills them."""
    import faulthandler
    import signal

    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)
    except (ValueError, RuntimeError, OSError, AttributeError):  # no stderr to write to, not the main thread
        pass
