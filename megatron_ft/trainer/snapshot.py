"""Asynchronous snapshotting: trainer state -> the agent's shared-memory slot, in the background.

Timeline of one snapshot at step s (REFT's clean/dirty double buffer)::

    main thread:  optimizer.step(s) -> snapshot(s) -> forward/backward(s+1) ... -> wait() -> optimizer.step(s+1)
    worker:                            begin -> copy chunk 0..n (fused copy+checksum) -> version record
                                       -> commit (agent flips the slot CLEAN)

``wait()`` waits for this rank's own copy only. Which step every rank holds is decided by the node
agents off the training path (``snapshot.agreement: agents``, :mod:`megatron_ft.agent.agreement`):
the commit's reply says the newest step the job agreed on as the agent knows it; a snapshot due
while this rank's previous one still waits for the agreement is skipped by the agent (counted).
``snapshot.agreement: collective`` keeps the design of before for comparison: the worker ends every
snapshot with a MIN all-reduce over every rank, which the next optimizer step waits for.

On a GPU the copies run on a dedicated CUDA stream straight into the page-locked slot, ordered after
the optimizer step by an event (:mod:`.device_staging`); the training stream goes on meanwhile.

``snapshot()`` only captures references (parameters and optimizer state do not change until the
next optimizer step) and tiny owned copies (RNG states), then returns. The copy runs on a
worker thread whose copy loop releases the GIL. ``wait()`` blocks only if the copy is not done
when the next optimizer step is about to modify the tensors.

A failed snapshot never stops training: the error is logged, the slot aborted, and the step is
simply not snapshotted. The agent learns that this rank is done with the step either way (its
commit, abort, refusal or ``skip``), so the job's agreement never waits for a step this rank will not
hold; with the collective agreement every rank still takes part in the collective for that step.
"""
from __future__ import annotations

import functools
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import fatal, faultpoints
from ..agent import shm
from ..agent.protocol import AgentClient, AgentError
from ..capture import checksum, snapfile
from ..capture.layout import Layout, plan_layout
from ..capture.state import LaterCapture, StateTensor
from . import device_staging, mapped_slots
from .restore_read import MAX_GPU_HOST_THREADS, threads_here

log = logging.getLogger("megatron_ft.trainer.snapshot")

# A failed registration (e.g. /dev/shm too small) is retried only this many steps later,
# so a job without room for snapshots keeps training at full speed and logs rarely.
REGISTER_RETRY_STEPS = 50
#: the longest a training step waits for the previous snapshot (its copy, its slot's begin and commit, the
#: collective agreement): far beyond what any of them takes - the last bound, after their own
WAIT_S = 600.0


@dataclass
class SnapshotStats:
    step: int
    ok: bool
    error: str = ""
    capture_s: float = 0.0  # time snapshot() spent on the training thread
    stall_s: float = 0.0  # training-visible: the checkpointer's capture + its wait before the next optimizer step
    copy_s: float = 0.0  # worker: begin .. commit
    clean_at: float = 0.0  # wall clock when the agent marked it clean
    agreed_step: int = -1
    nbytes: int = 0
    #: skipped by the agent: this rank's previous snapshot still waited for the job's agreement
    pending: bool = False
    #: worker seconds by phase: begin (the agent's slot), copy (GPU path: copies and sums until both are
    #: done; host path: the fused copy and checksum), record (the version record), commit (the agent's reply)
    phases: dict = field(default_factory=dict)


def stall_summary(history: list[SnapshotStats]) -> dict:
    """What training saw of its snapshots: how many were taken (committed) and failed, the
    training-visible stall per snapshot (median and largest), the worker's copy time (median) and
    the bytes of one snapshot. The median leaves out the first snapshot's one-time registration.

    >>> h = [SnapshotStats(1, True, stall_s=0.5, copy_s=0.2, nbytes=64), SnapshotStats(2, True, stall_s=0.01, copy_s=0.1,
    ...      nbytes=64), SnapshotStats(3, False, error="not started: x", stall_s=0.02), SnapshotStats(4, True, stall_s=0.03,
    ...      copy_s=0.1, nbytes=64)]
    >>> stall_summary(h)
    {'taken': 3, 'failed': 1, 'skipped_pending_agreement': 0, 'stall_median_s': 0.025, 'stall_max_s': 0.5, 'copy_median_s': 0.1, 'nbytes': 64}
    """
    def median(xs: list[float]) -> Optional[float]:
        xs = sorted(xs)
        if not xs:
            return None
        mid = len(xs) // 2
        return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2

    ok = [h for h in history if h.ok]
    skipped = sum(1 for h in history if h.pending)
    return {"taken": len(ok), "failed": len(history) - len(ok) - skipped, "skipped_pending_agreement": skipped,
            "stall_median_s": median([h.stall_s for h in history]),
            "stall_max_s": max((h.stall_s for h in history), default=None),
            "copy_median_s": median([h.copy_s for h in ok]),
            "nbytes": max((h.nbytes for h in ok), default=0)}


@dataclass
class _Job:
    step: int
    tensors: list[StateTensor]
    extra: dict
    slot: Optional[int]
    started: float
    stats: SnapshotStats
    ready: Any = None  # GPU path: event after the optimizer step, which the device-to-host copies wait for
    begin: bool = False  # the worker asks the agent for a slot first
    loss: Optional[float] = None  # the step's training loss, recorded by the agent at commit (the guard's history)
    later: Optional[LaterCapture] = None  # the worker encodes the state first (then registers its layout)
    done: threading.Event = field(default_factory=threading.Event)


def _finite(loss: Optional[float]) -> Optional[float]:
    return loss if loss is not None and math.isfinite(loss) else None


class SnapshotEngine:
    """Trainer-side staging of snapshots into this rank's agent slots. ``coord_group``: with the
    collective agreement (``collective=True``), the group of every rank the worker's MIN all-reduce
    runs on; otherwise unused (the agents agree)."""

    def __init__(self, client: AgentClient, rank: int, identity: dict, chunk_size: int,
                 coord_group: Any = None, agree: bool = True, required: bool = False, collective: bool = False):
        self.client = client
        self.rank = rank
        self.identity = identity
        self.chunk_size = chunk_size
        self.coord_group = coord_group
        self.collective = collective
        self.agree = agree and collective and dist.is_available() and dist.is_initialized()
        self.world_collectives = 0  # megatron-ft's collectives over every rank (the scale benchmark counts them)
        self.required = required  # no shared memory for the slots ends the job (agent.required)
        self.layout: Optional[Layout] = None
        self._pieces: list = []  # layout.all_pieces(), computed once per registration
        self._slots: list[shm.Segment] = []
        self._staging: Optional[device_staging.SnapshotStaging] = None  # GPU path: state on a CUDA device
        self._page_lock_slots = False  # GPU path: the worker page-locks new slots before its next copy
        self._q: "queue.Queue[Optional[_Job]]" = queue.Queue()
        self._pending: Optional[_Job] = None
        self.history: list[SnapshotStats] = []
        self.last_committed = -1
        self.last_agreed = -1
        self._register_retry_step = -1  # after a failed registration, retry from this step on
        self._doing = "idle"  # what the worker does now (named when a wait for it times out)
        self._worker = threading.Thread(target=self._run, name=f"mft-snapshot-r{rank}", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ training thread
    def snapshot(self, step: int, tensors: list[StateTensor], extra: dict, loss: Optional[float] = None) -> SnapshotStats:
        """Start a snapshot of ``tensors``/``extra`` as step ``step`` (whose training loss, where this
        rank knows it, the agent records with the commit). Returns quickly, with the snapshot's
        statistics (filled in by the worker until :meth:`wait` returns them)."""
        t0 = time.perf_counter()
        self.wait()
        stats = SnapshotStats(step, False)
        registered = self._register(step, tensors, stats)
        # the worker asks the agent for a slot (``begin``): a round trip training need not wait for
        job = _Job(step, tensors if registered else [], extra, None, time.time(), stats, begin=registered,
                   loss=_finite(loss))
        if registered and self._staging is not None:
            job.ready = self._staging.ready_point()
        return self._start(job, t0)

    def snapshot_later(self, step: int, later: LaterCapture, loss: Optional[float] = None) -> SnapshotStats:
        """:meth:`snapshot` of a state the worker encodes first (and whose layout it registers), so
        that the training thread only hands it over: for adapters whose encoding walks a large
        structure (Megatron-LM's state dict). On the GPU path the copies wait for an event recorded
        here, after whatever the adapter queued when it took the state."""
        t0 = time.perf_counter()
        self.wait()
        job = _Job(step, [], {}, None, time.time(), SnapshotStats(step, False), loss=_finite(loss), later=later)
        if later.device is not None:  # GPU path
            job.ready = device_staging.stream_point(later.device)
        return self._start(job, t0)

    def _start(self, job: _Job, t0: float) -> SnapshotStats:
        job.stats.capture_s = time.perf_counter() - t0
        self._pending = job
        self._q.put(job)
        return job.stats

    def _register(self, step: int, tensors: list[StateTensor], stats: SnapshotStats) -> bool:
        """Register ``tensors``' layout with the agent if it changed; False (logged, retried
        :data:`REGISTER_RETRY_STEPS` later) if it cannot be: no snapshot this step."""
        try:
            if step < self._register_retry_step:
                raise RuntimeError(f"registration failed earlier; retrying at step {self._register_retry_step}")
            self._ensure_registered(tensors)
            return True
        except Exception as e:  # no snapshot this step; training goes on
            if self.required and getattr(e, "kind", "") == "SharedMemoryError":
                fatal.end_job(f"rank {self.rank}: no shared memory for its snapshot slots: {e} "
                              f"(agent.required: false trains unprotected instead)")
            if not str(e).startswith("registration failed earlier"):
                self._register_retry_step = step + REGISTER_RETRY_STEPS
                log.warning("rank %d: snapshot of step %d skipped: %s", self.rank, step, e)
            stats.error = f"not started: {e}"
            return False

    def skip(self, step: int, reason: str) -> SnapshotStats:
        """Take part in step ``step``'s agreement without a snapshot (e.g. the state could not be
        captured): the other ranks' collective never hangs, and the agreed step stays older."""
        self.wait()
        stats = SnapshotStats(step, False, error=f"not started: {reason}")
        job = _Job(step, [], {}, None, time.time(), stats)
        self._pending = job
        self._q.put(job)
        return stats

    def wait(self, wait_s: Optional[float] = None) -> Optional[SnapshotStats]:
        """Block until the pending snapshot (if any) is committed (and, with the collective agreement,
        agreed): at most ``wait_s`` (default :data:`WAIT_S`), then :class:`TimeoutError` naming the step
        and what the worker is doing. Every call the worker makes is bounded on its own (the agent's
        requests by ``agent.request_timeout_s``, a collective by its group's timeout, a copy by its
        size), so this bound is the last line: a worker stuck beyond it ends the trainer with that
        error (restarted and restored like any failed trainer) rather than hanging it."""
        job = self._pending
        if job is None:
            return None
        limit = WAIT_S if wait_s is None else wait_s
        if not job.done.wait(limit):
            raise TimeoutError(f"rank {self.rank}: the snapshot of step {job.step} did not finish within "
                               f"{limit:g} s (its worker is {self._doing})")
        self._pending = None
        return job.stats

    def close(self) -> None:
        self.wait()
        self._q.put(None)
        self._worker.join(timeout=30)
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        self._slots = []  # (their mappings stay kept for the process: mapped_slots)

    # ------------------------------------------------------------------ registration
    def _ensure_registered(self, tensors: list[StateTensor]) -> None:
        specs = [t.spec() for t in tensors]
        if self.layout is not None and [e.spec for e in self.layout.entries] == specs:
            return
        layout = plan_layout(specs, self.chunk_size, self.identity)
        reply = self.client.request("register", rank=self.rank, layout=layout.to_json().decode())
        if self._staging is not None:
            self._staging.unregister()
        self._slots = mapped_slots.slot_mappings(reply["slots"])  # (a restore may have mapped one already)
        device = device_staging.cuda_device_of([t.tensor for t in tensors])  # GPU path
        if device is not None:
            if self._staging is None:
                self._staging = device_staging.SnapshotStaging(device, threads_here(MAX_GPU_HOST_THREADS))
            self._page_lock_slots = True  # on the worker: page-locking 16 GiB takes most of a second
        self.layout = layout
        self._pieces = layout.all_pieces()
        log.info("rank %d: registered %d tensors, %.1f MiB in %d chunks (%s)", self.rank, len(specs),
                 layout.data_nbytes / 2**20, layout.num_chunks, "adopted" if reply.get("adopted") else "new slots")

    # ------------------------------------------------------------------ worker thread
    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                if job.later is not None:
                    self._doing = f"encoding step {job.step}'s state"
                    self._encode(job)
                if job.begin:
                    self._doing = f"asking its agent for a slot for step {job.step}"
                    t0 = time.perf_counter()
                    job.slot = self._begin(job)
                    job.stats.phases["begin"] = time.perf_counter() - t0
                if job.slot is not None:
                    self._doing = f"copying and committing step {job.step}"
                    self._write(job)
                elif not job.stats.pending and not self.collective:
                    self._skip(job)
            except Exception as e:
                job.stats.error = f"{type(e).__name__}: {e}"
                log.warning("rank %d: snapshot of step %d failed: %s", self.rank, job.step, job.stats.error)
                try:
                    self.client.request("abort", rank=self.rank, slot=job.slot)
                except Exception:
                    pass
            try:
                if self.collective:
                    self._doing = f"in step {job.step}'s collective agreement"
                    self._agree(job)
            except Exception as e:
                log.warning("rank %d: agreement for step %d failed: %s", self.rank, job.step, e)
            self.history.append(job.stats)
            if len(self.history) > 1000:
                del self.history[:500]
            self._doing = "idle"
            job.done.set()

    def _encode(self, job: _Job) -> None:
        """A later capture's state encoded and its layout registered (worker); a failure costs this
        snapshot only (the job still takes part in the agreement)."""
        t0 = time.perf_counter()
        later, job.later = job.later, None
        try:
            tensors, job.extra = later.encode()
        except Exception as e:
            job.stats.error = f"not started: capture failed: {e}"
            log.warning("rank %d: could not capture the state of step %d: %s", self.rank, job.step, e)
        else:
            job.begin = self._register(job.step, tensors, job.stats)
            job.tensors = tensors if job.begin else []
        job.stats.phases["capture"] = time.perf_counter() - t0

    def _begin(self, job: _Job) -> Optional[int]:
        """The agent's slot for ``job`` (it keeps the other slot's version intact), or None: no
        snapshot this step (logged; training goes on)."""
        try:
            return int(self.client.request("begin", rank=self.rank, step=job.step)["slot"])
        except Exception as e:
            if getattr(e, "kind", "") == "PendingAgreement":  # defined, counted, not a failure
                job.stats.pending = True
                job.stats.error = f"skipped: {e}"
                log.info("rank %d: %s", self.rank, e)
                return None
            if self.required and getattr(e, "kind", "") == "SharedMemoryError":  # the node's peers' blocks
                fatal.end_job(f"rank {self.rank}: {e} (agent.required: false trains unprotected instead)")
            job.stats.error = f"not started: {e}"
            log.warning("rank %d: snapshot of step %d skipped: %s", self.rank, job.step, e)
            return None

    def _write(self, job: _Job) -> None:
        assert self.layout is not None and job.slot is not None
        layout = self.layout
        t0 = time.perf_counter()
        seg = self._slots[job.slot]
        hdr = snapfile.read_header(seg.mm)
        area = self._data_area(job, seg)[hdr.geometry.data_off: hdr.geometry.data_off + layout.data_nbytes]
        if job.ready is not None:  # GPU path: straight into the page-locked slot, on a side stream
            assert self._staging is not None
            files = self._staging.files
            locked = files[job.slot] if job.slot < len(files) else None
            sums = self._staging.copy_and_sum(
                job.ready, area, self._pieces, layout.chunk_bounds, [_bytes_of(t.saved_view()) for t in job.tensors],
                after_first_chunk=lambda: faultpoints.reached("mid-copy", job.step, self.rank),
                cut=functools.partial(locked.pieces, offset=hdr.geometry.data_off) if locked is not None else None)
            job.stats.phases.update(self._staging.last_phases)
        else:
            sums = self._copy_and_sum(job, area)
        t1 = time.perf_counter()
        record = {"chunks": [f"{s:016x}" for s in sums], "checksum": checksum.ALGORITHM,
                  "extra": job.extra, "created": job.started, "identity": self.identity}
        snapfile.write_version(seg.mm, job.step, record)
        t2 = time.perf_counter()
        reply = self.client.request("commit", rank=self.rank, slot=job.slot, step=job.step,
                                    **({"loss": float(job.loss)} if job.loss is not None else {}))
        self._learn_agreed(job, reply)
        job.stats.phases.update(copy=t1 - t0, record=t2 - t1, commit=time.perf_counter() - t2)
        faultpoints.reached("after-commit", job.step, self.rank, area=area, path=seg.path, size=seg.size)
        job.stats.ok = True
        job.stats.copy_s = time.perf_counter() - t0
        job.stats.clean_at = time.time()
        job.stats.nbytes = layout.data_nbytes
        self.last_committed = job.step

    def _data_area(self, job: _Job, seg: shm.Segment):
        """The whole slot file ``job`` writes, as the copies address it: the engine's own mapping, or on
        the GPU path the process's page-locked one (the slots page-locked first, once per layout: the
        training thread asked for it and went on)."""
        if job.ready is None:
            return seg.array
        assert self._staging is not None and job.slot is not None
        if self._page_lock_slots:
            self._page_lock_slots = False
            self._staging.register(self._slots)
        areas = self._staging.areas
        return areas[job.slot] if job.slot < len(areas) and areas[job.slot] is not None else seg.array

    def _copy_and_sum(self, job: _Job, area) -> list[int]:
        """Host state: copy each chunk's pieces into the slot while summing them (one pass)."""
        assert self.layout is not None
        return copy_and_sum(self.layout, self._pieces, job.tensors, area,
                            lambda: faultpoints.reached("mid-copy", job.step, self.rank))

    def _skip(self, job: _Job) -> None:
        """No snapshot of ``job``'s step on this rank: the agent learns it (the job's agreement then does
        not wait for this rank's copy of it). Best effort."""
        try:
            self._learn_agreed(job, self.client.request("skip", rank=self.rank, step=job.step))
        except (AgentError, OSError, ConnectionError) as e:
            log.warning("rank %d: could not tell the agent step %d is skipped: %s", self.rank, job.step, e)

    def _learn_agreed(self, job: _Job, reply: dict) -> None:
        """The job's agreed step from an agent's reply (agents mode)."""
        agreed = reply.get("agreed") if isinstance(reply, dict) else None
        if isinstance(agreed, int):
            job.stats.agreed_step = agreed
            self.last_agreed = max(self.last_agreed, agreed)

    def _agree(self, job: _Job) -> None:
        """All ranks (the collective agreement): the newest step every rank has committed; tell the
        agent it is consistent."""
        if self.agree:
            t = torch.tensor([self.last_committed], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.coord_group)
            self.world_collectives += 1
            agreed = int(t.item())
        else:
            agreed = self.last_committed
        job.stats.agreed_step = agreed
        if agreed >= 0 and agreed > self.last_agreed:
            self.last_agreed = agreed
            try:
                self.client.request("global", rank=self.rank, step=agreed)
            except (AgentError, OSError, ConnectionError) as e:
                log.warning("rank %d: could not tell the agent step %d is consistent: %s", self.rank, agreed, e)


def copy_and_sum(layout: Layout, pieces: list, tensors: list[StateTensor], area,
                 after_first_piece: Optional[Any] = None) -> list[int]:
    """Host state: each chunk's pieces (``layout.all_pieces()``) copied from ``tensors`` into ``area`` (the
    container's data area, as a uint8 array) while summed, in one pass; the chunks' sums, in order.
    ``after_first_piece()`` (if given) runs once the first piece is in (the fault points' mid-copy)."""
    sources = [_bytes_of(t.saved_view()).cpu() for t in tensors]  # .cpu(): no-op for host tensors
    sums = []
    for i, chunk_pieces in enumerate(pieces):
        lo, hi = layout.chunk_bounds(i)
        chunk = checksum.ChunkSum(hi - lo, area[lo:hi])
        for k, p in enumerate(chunk_pieces):
            chunk.write(p.dst_offset - lo, sources[p.entry_index][p.src_start:p.src_end])
            if i == 0 and k == 0 and after_first_piece is not None:
                after_first_piece()
        sums.append(chunk.finish())
    return sums


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes, on the tensor's device (a CUDA tensor's
    bytes are copied to the host by :mod:`.device_staging`)."""
    t = t.contiguous()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.view(-1).view(torch.uint8)
