"""The scheduled transport: trainers send their latest clean snapshot to the peers
that hold its copies, in the chunks and at the times of a :class:`~megatron_ft.schedule.modes.SendSchedule`;
the receiving trainer lands each chunk in its agent's shared memory and tells its agent when every
chunk is there.

Byte path of one transfer of version ``S`` from rank ``r`` (node A) to rank ``r'`` (same local
index on node B, which holds ``copy.r{r}``)::

    A: agent slot of S (pinned: sched_pin) --(GPU: H2D, side stream)--> staging buffer --send--> B
    B: --recv--> staging buffer --(GPU: D2H, side stream)--> agent block copy.r{r}, version S (sched_recv_begin)
    (on CPU gloo sends from a window of the slot and receives into a window of the block: no copies)
    B: after the last chunk: sched_recv_done -> B's agent marks the block complete, announces S

``S`` is the step every rank agreed on (the snapshot engine's ``last_agreed``, read where the engine is
idle), so all ranks send the same version and the group holds a consistent cut. A transfer starts
every ``interval_iterations`` iterations, at the same iteration on every rank; a failure midway
leaves the block incomplete and the previous complete version in use.

**Process groups, threads, timeouts.** The transport makes its own groups, each spanning only the
ranks that exchange copies with this one (:func:`exchange_ranks`: this rank's local index on the nodes
of its redundancy group that send or receive a copy; a pair of ranks for two-node replica groups,
never the world unless the plan's group is the world), created by those ranks alone
(:func:`member_group`: ``use_local_synchronization``, where torch has it; a rank that belongs to fewer
groups than others first makes groups of itself alone until the counts agree, since torch names a
locally made group by the process's group count; without that argument, or for NCCL on a bound default
group, every rank makes every such group, in one order); a rank that exchanges with nobody makes none:

* ``ctl`` (gloo, torch's default timeout): the planning exchange of bubbles
  (:meth:`~ScheduledTransport.exchange_bubbles`), on the training thread. The two planning steps that
  must be the same on every rank (:meth:`ScheduledTransport.agree`, :meth:`~ScheduledTransport.ranks_on_my_host`)
  run on the job's default group, which already exists: no group of the world is made.
* ``ctrl`` (gloo, :data:`CTRL_TIMEOUT` = 24 h): each transfer's header and chunk table, and the bye.
  The training thread sends them; one receiver thread per source rank (``mft-sched-recv-r{R}-from{S}``)
  receives them, and waits in that receive from one checkpoint to the next for as long as training
  runs (an ``off`` segment, an evaluation or a long interval included), hence the day.
* the data group (the job's backend: NCCL on GPUs, gloo on CPU), one per timeout in use, with a
  timeout of :func:`~megatron_ft.transport.p2p_batch.data_timeout_s` of the agreed schedules (60 s
  unless a chunk needs more than 6 s at the planned rate; :func:`schedule_timeout_s`). Created by
  :meth:`~ScheduledTransport.agree` (collective) with an eager barrier, so the communicator is built
  with every rank of the group taking part (``batch_isend_irecv`` requires that of the first collective call on
  an NCCL group); from then on **only the p2p driver thread** (``mft-sched-p2p-r{R}``) touches it: NCCL
  communicators are not thread-safe, and one communicator's operations run on one stream in issue
  order. The driver executes every chunk in the order of :mod:`megatron_ft.transport.p2p_batch`
  (keys both ends compute; one ``batch_isend_irecv`` per key, a send and a receive of the same key
  together), waits for each batch on the host, and resolves its operations. The same timeout bounds
  its wait for the sources' headers when a transfer starts. A batch that fails or times out stops
  the transport (on NCCL, PyTorch's watchdog also acts on the timed-out communicator as
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` says: by default it ends the process).

The training thread only releases work to the driver (the chunks of an iteration, with their due
times) and waits for it in ``blocking`` / ``end`` modes and when a transfer is finished; the
receiver threads hand each announced transfer (its table and the agent's block) to the driver and
wait until the driver has received every chunk of it.

**The link gate** (:class:`GateClock`, a :class:`~megatron_ft.schedule.link_gate.LinkGate` on the
clock, made by :meth:`ScheduledTransport.use_link`). A schedule with ``gate_window_s`` > 0 ignores
its chunks' planned offsets: the training thread reports each of its own network calls to the gate
(begin / end, from the pipeline hooks), and the driver sends a chunk only once the gate lets it onto
the link (:func:`exchange_gated` on gloo: every receive of the release posted at once, each send
after the gate; on NCCL each batch with a send waits for the gate, still in key order). A chunk
waits at most ``2 x quiet_s`` (then goes, counted in ``GateClock.forced``). Lock order: the gate's
lock is a leaf - taken by the training thread's hooks and the driver, never held while waiting on
anything else.

Wire format on ``ctrl``, no pickle: a header of 8 int64 ``[MAGIC, VERSION, kind, start, step,
length, nchunks, columns]`` (kind 1 = transfer, 2 = bye, 3 = no transfer this time; ``start``: the
iteration step after which the transfer started, the same on every rank), then for a transfer an
int64 table of ``nchunks x (offset, size, iteration, at_ms, seq)`` (the chunk's key). The chunks
travel on the data group.

**Checks only a GPU machine can make** (``tests/gpu/test_scheduled_nccl.py``, two or more GPUs):
that two ranks exchanging large chunks both ways complete on NCCL (the ungrouped sends this
transport used to issue from two threads can deadlock there; gloo does not serialise them); that the first
batch after the eager barrier needs no other rank; the side-stream staging (host -> device before
the wire, device -> host before a block is released); and the driver thread's device (a new thread
starts on device 0 unless told).
"""
from __future__ import annotations

import collections
import dataclasses
import inspect
import logging
import math
import queue
import socket
import threading
import time
import warnings
import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .. import clock
from ..redundancy.exchange import holders_of_whole
from ..redundancy.plan import plan_from_config
from ..schedule.link_gate import LinkGate
from ..schedule.modes import SendSchedule
from .p2p_batch import (END_BOUND, RECV, SEND, Op, Planned, batch_p2p, data_timeout_s, plan_transfer,
                        release_bound, send_keys)

log = logging.getLogger("megatron_ft.transport")

MAGIC = 0x4D4654534348  # "MFTSCH"
WIRE_VERSION = 2
KIND_TRANSFER, KIND_BYE, KIND_SKIP = 1, 2, 3
TAG_HEADER, TAG_TABLE, TAG_CHUNK = 71, 72, 73
HEADER_LEN, TABLE_COLUMNS = 8, 5
CTRL_TIMEOUT = timedelta(hours=24)  # a receiver thread waits for the next header as long as training runs
BYE_TIMEOUT = timedelta(seconds=30)
MAX_RECORDS = 4096  # per list kept for the run's transport file
MAX_CTRL_PENDING = 64  # header sends a peer never took (it stopped), kept referenced


def peers_of(cfg: Any, rank: int) -> tuple[list[int], list[int]]:
    """(ranks this rank sends its copies to, ranks whose copies it receives): the rank with the same
    local index on every node that holds a copy of this rank's container (GEMINI placement).

    Two nodes of two ranks, replica m = 2: rank 1 (node 0) sends to rank 3 (node 1) and receives
    from rank 3; rank 2 sends to and receives from rank 0."""
    plan = plan_from_config(cfg)
    topo = plan.topology
    rpn = cfg.cluster.ranks_per_node
    node, local = divmod(rank, rpn)
    dsts = [n * rpn + local for n in holders_of_whole(plan, rank)[1:]]
    srcs = [n * rpn + local for n in range(topo.nodes) if n != node
            and node in holders_of_whole(plan, n * rpn + local)[1:]]
    return dsts, srcs


def _exchanging(plan: Any, rpn: int, group: Any, local: int) -> tuple[int, ...]:
    """The ranks of local index ``local`` on the nodes of redundancy group ``group`` that send or
    receive a whole copy (sorted; empty when nobody in it does)."""
    nodes: set[int] = set()
    for n in group.members:
        holders = holders_of_whole(plan, n * rpn + local)
        if len(holders) > 1:
            nodes.update(holders)
    return tuple(sorted(n * rpn + local for n in nodes))


def exchange_ranks(cfg: Any, rank: int) -> tuple[int, ...]:
    """The ranks the scheduled transport's groups of ``rank`` span: every rank of ``rank``'s local
    index on the nodes of its redundancy group that sends or receives a copy (so every rank it sends
    to or receives from, :func:`peers_of`), sorted; ``(rank,)`` when it exchanges with nobody. Every
    rank of the result computes the same tuple.

    Four nodes of one rank, replica m = 2 (groups {0, 1} and {2, 3}): rank 2's groups span (2, 3)."""
    plan = plan_from_config(cfg)
    rpn = cfg.cluster.ranks_per_node
    node, local = divmod(rank, rpn)
    ranks = _exchanging(plan, rpn, plan.groups[plan.node_group[node]], local)
    return ranks if rank in ranks else (rank,)


def all_exchange_ranks(cfg: Any) -> list[tuple[int, ...]]:
    """Every :func:`exchange_ranks` of more than one rank in the job, in one order every rank computes
    (redundancy group, then local index): the groups a rank must take part in creating where torch
    cannot create a group among its members alone."""
    plan = plan_from_config(cfg)
    rpn = cfg.cluster.ranks_per_node
    out = []
    for group in plan.groups:
        for local in range(rpn):
            ranks = _exchanging(plan, rpn, group, local)
            if len(ranks) > 1:
                out.append(ranks)
    return out


#: whether this torch creates a group among its members alone (``new_group(use_local_synchronization=True)``)
LOCAL_SYNCHRONIZATION = "use_local_synchronization" in inspect.signature(dist.new_group).parameters


def groups_belonged_to() -> int:
    """How many process groups this process is a member of (the default group included), as torch
    counts them when it names a group made with ``use_local_synchronization``; -1 where this torch
    does not say (its registry, ``distributed_c10d._world.pg_names``, is private)."""
    try:
        return len(dist.distributed_c10d._world.pg_names)
    except Exception:
        return -1


def member_group(ranks: Sequence[int], every: Callable[[], Sequence[Sequence[int]]], backend: str,
                 timeout: Optional[timedelta] = None, local: bool = True) -> Any:
    """A process group of ``ranks`` (this rank among them, more than one). With ``local`` (the caller
    established that every rank belongs to equally many groups: :func:`groups_belonged_to`) it is
    made by its members alone: ``use_local_synchronization=True``, the ranks outside it never call
    ``new_group`` for it, and only its members meet in the store. torch 2.13 names such a group
    after its ranks and the number of groups the calling process belongs to, so members whose
    counts differ (Megatron puts only some pipeline stages in its embedding groups) would wait in
    different places for ever. Otherwise, without that argument (an older torch), or for an NCCL
    group when the default group is bound to a device (torch then splits the default group's
    communicator, which every rank of the default group must join), every rank calls ``new_group``
    for each of ``every()`` in that order, as torch requires, and gets the one it is in: each rank is
    a member of one, the calls for the others only count them. Every rank must pass the same
    ``local`` and make the transport's groups in the same order."""
    kw = {"backend": backend} if timeout is None else {"backend": backend, "timeout": timeout}
    bound = getattr(dist.group.WORLD, "bound_device_id", None) is not None
    if local and LOCAL_SYNCHRONIZATION and not (bound and backend == "nccl"):
        return dist.new_group(ranks=list(ranks), use_local_synchronization=True, **kw)
    mine = None
    for group_ranks in every():
        group = dist.new_group(ranks=list(group_ranks), **kw)
        if tuple(group_ranks) == tuple(ranks):
            mine = group
    if mine is None:
        raise ValueError(f"ranks {list(ranks)} are not among the groups every rank makes")
    return mine


def schedule_timeout_s(schedule: SendSchedule) -> int:
    """The data group's timeout for ``schedule``: :func:`~.p2p_batch.data_timeout_s` of its largest
    chunk at its planned rate (its bytes over its planned seconds, start-up times included, so never
    faster than the link model it was planned with)."""
    sizes = [s.size for s in schedule.sends]
    rate = sum(sizes) / schedule.planned_transfer_s if schedule.planned_transfer_s > 0 else math.inf
    return data_timeout_s(max(sizes, default=0), rate)


def exchange(group: Any, batch: list[Op], stream: Optional[Any] = None) -> None:
    """Issue ``batch`` as one ``batch_isend_irecv`` on ``group``, wait for it on the host, then run each
    operation's ``on_done``. Only the thread that owns ``group`` calls this.

    ``stream`` (GPU only, None on CPU): the transport's side stream. Sends are staged host -> device
    on it and it is synchronized before the batch is issued; after the batch it waits for NCCL's
    work (``Work.wait`` orders the current stream after it) and copies received chunks device ->
    host, and is synchronized again before anything is resolved, so a staging buffer is reused and
    a block released only once its bytes are where they belong. Nothing here runs on the default
    stream, so no copy queues behind training kernels. Raises what the batch raised."""
    if stream is not None:  # ---- GPU only
        with torch.cuda.stream(stream):
            for op in batch:
                if op.direction == SEND and op.host is not None:
                    op.tensor.copy_(op.host, non_blocking=True)
        stream.synchronize()
    issued = time.perf_counter()
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend if op.direction == SEND else dist.irecv, op.tensor,
                                               op.peer, group, TAG_CHUNK) for op in batch])
    if stream is None:  # gloo: each work waited exactly once (a second wait blocks for ever)
        for w in works:
            w.wait()
    else:  # ---- GPU only: NCCL's wait does not block the host; the stream's synchronize does
        with torch.cuda.stream(stream):
            for w in works:
                w.wait()
            for op in batch:
                if op.direction == RECV and op.host is not None:
                    op.host.copy_(op.tensor, non_blocking=True)
        stream.synchronize()
    finished = time.perf_counter()
    for op in batch:
        _resolve(op, issued, finished)


def exchange_gated(group: Any, ops: Sequence[Op], gate: "GateClock") -> None:
    """CPU (gloo) only: every receive of ``ops`` posted at once (a receive takes nothing of this rank's
    link), then each send in key order once ``gate`` lets it onto the link, waited on the host;
    then the receives waited. Each operation's ``on_done`` runs as in :func:`exchange`.
    Deadlock-free on gloo: every receive of the release is posted before any send waits, on both
    ends, and a source's chunks match its receives in key order (one tag).

    The operations go to ``group``'s process group directly (``ProcessGroup.send`` / ``recv``, what
    ``torch.distributed.isend`` / ``irecv`` call after their checks, made once here for all): this
    runs once per chunk, on a thread that shares the interpreter lock with training."""
    ops = sorted(ops, key=lambda o: o.key)
    ranks = {peer: dist.get_group_rank(group, peer) for peer in {op.peer for op in ops}}
    posted: list = []
    for op in ops:
        if op.direction == RECV:
            posted.append((op, group.recv([op.tensor], ranks[op.peer], TAG_CHUNK), time.perf_counter()))
    for op in ops:
        if op.direction != SEND:
            continue
        gate.wait(op.tensor.numel())
        issued = time.perf_counter()
        group.send([op.tensor], ranks[op.peer], TAG_CHUNK).wait()
        _resolve(op, issued, time.perf_counter())
    for op, work, issued in posted:
        work.wait()
        _resolve(op, issued, time.perf_counter())


def _resolve(op: Op, issued: float, finished: float) -> None:
    if op.on_done is not None:
        op.on_done(issued, finished)


class GateClock:
    """A :class:`~megatron_ft.schedule.link_gate.LinkGate` on ``time.perf_counter()``, shared by the
    training thread (:meth:`begin` / :meth:`end` around each of training's network operations, from
    the pipeline hooks) and the p2p driver (:meth:`wait` before each send). One lock, held only
    inside these methods; :meth:`wait` sleeps on it and gives up after ``max_wait_s`` (the chunk
    then goes anyway: a gate that never opens must not hold a transfer for ever), counted in
    ``forced``. :meth:`end` wakes the waiting driver only if the gate now lets its chunk go before the
    driver would wake by itself: each wake-up is a thread switch on a core training may need, and most
    of training's calls open no window the chunk fits (``wakeups`` counts them)."""

    def __init__(self, bandwidth: float, quiet_s: float, max_wait_s: float):
        self._cond = threading.Condition()
        self.gate = LinkGate(bandwidth, 0.0, quiet_s)
        self.max_wait_s = max_wait_s
        self.forced = 0
        self.waited_s = 0.0
        self.wakeups = 0
        self._waiting: Optional[int] = None  # the bytes of the chunk the driver waits with
        self._wake_at = math.inf  # when the waiting driver wakes by itself

    def begin(self) -> None:
        with self._cond:
            self.gate.begin(time.perf_counter())

    def end(self, start: float, nbytes: int = 0, window_s: Optional[float] = None) -> None:
        with self._cond:
            now = time.perf_counter()
            self.gate.end(start, now, nbytes, window_s)
            if self._waiting is not None:
                at = self.gate.earliest(now, self._waiting)
                if at is not None and at < self._wake_at:
                    self._cond.notify_all()

    def wait(self, nbytes: int) -> None:
        t0 = now = time.perf_counter()
        with self._cond:
            self._waiting = nbytes
            try:
                while True:
                    at = self.gate.earliest(now, nbytes)
                    if at is not None and at <= now:
                        break
                    left = t0 + self.max_wait_s - now
                    if left <= 0:
                        self.forced += 1
                        break
                    timeout = min(left, at - now) if at is not None else left
                    self._wake_at = now + timeout
                    self._cond.wait(timeout)  # or woken by end()
                    self.wakeups += 1
                    now = time.perf_counter()
            finally:
                self._waiting, self._wake_at = None, math.inf
            self.gate.sent(now, nbytes)
            self.waited_s += now - t0


class _Driver:
    """The p2p driver: one daemon thread running submitted jobs one at a time, in submission order.
    Every operation on the transport's data groups runs in its jobs (see the module docstring).
    ``cpu_s``: the CPU time the thread has spent in its jobs (read it after :meth:`stop`)."""

    def __init__(self, name: str, device: torch.device):
        self._device = device
        self.cpu_s = 0.0
        self._q: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        self._q.put((fut, fn, args))
        return fut

    def stop(self, timeout: float) -> bool:
        """Stop after the jobs already submitted; False if the thread is still busy after ``timeout``."""
        self._q.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        if self._device.type == "cuda":  # GPU only: a new thread starts on device 0
            torch.cuda.set_device(self._device)
        while True:
            item = self._q.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            t0 = time.thread_time()
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # the submitter sees it in the future
                fut.set_exception(e)
            finally:
                self.cpu_s += time.thread_time() - t0


@dataclass(eq=False)
class _Incoming:
    """What a source announced for one transfer (its header and table), and the block it goes to.
    The receiver thread of ``src`` creates it, opens and closes the block; the driver receives into
    it and sets ``done`` once every chunk arrived."""
    src: int
    kind: int  # KIND_TRANSFER | KIND_SKIP | KIND_BYE (the source is gone)
    start: int  # the iteration step after which the transfer started
    step: int = -1
    length: int = 0
    rows: list = field(default_factory=list)  # (key, offset, size), the source's chunk table
    dst: Optional[torch.Tensor] = None  # the agent's block, uint8 (None: nowhere to put it, drained and dropped)
    stage: Optional[torch.Tensor] = None  # GPU: where chunks land; CPU: scratch for chunks with nowhere to go
    remaining: int = 0
    done: threading.Event = field(default_factory=threading.Event)

    def inside(self, offset: int, size: int) -> bool:
        return self.dst is not None and 0 <= offset and size >= 0 and offset + size <= self.length

    @property
    def complete(self) -> bool:
        return (all(self.inside(off, size) for _, off, size in self.rows)
                and sum(size for _, _, size in self.rows) == self.length)

    def arrived(self, issued: float = 0.0, finished: float = 0.0) -> None:
        self.remaining -= 1
        if self.remaining <= 0:
            self.done.set()


@dataclass(eq=False)
class _Transfer:
    """One transfer slot: every rank has one at each transfer start, with or without its own
    snapshot to send (``seg`` None: it sends nothing, but receives what its sources send)."""
    step: int  # the snapshot step sent (-1: none)
    seg: Any  # the slot's mapped segment (``open_segment``'s), or None
    started_at: int  # the snapshot step after which it started
    group: Any  # its data group
    timeout_s: int
    own: list  # this rank's sends: (key, dst, offset, size)
    send_buf: Optional[torch.Tensor] = None  # GPU: the device staging buffer of sends
    view: Optional[torch.Tensor] = None  # seg's bytes, uint8 (driver thread, from the plan on; dropped before close)
    iteration: int = 0  # next iteration of the schedule to release
    plan: Optional[list[Planned]] = None  # set by the driver once every source's header is in
    cursor: int = 0  # plan[:cursor] released
    incoming: dict = field(default_factory=dict)  # src -> _Incoming
    ctrl: list = field(default_factory=list)  # (work, tensor) of the header and table sends
    releases: list = field(default_factory=list)  # Future per release
    completed: collections.deque = field(default_factory=collections.deque)  # (issued, finished, bytes) per send
    sent: int = 0
    gated: bool = False  # its sends go when the link gate opens (the schedule's gate_window_s > 0)


class ScheduledTransport:
    """One per trainer rank. The training loop calls :meth:`begin_iteration` at the start of each
    iteration and :meth:`end_iteration` after the optimizer step, before the next snapshot starts
    (the snapshot engine is idle there); :meth:`agree` (collective: every rank, in the same order)
    and :meth:`use` (at the same step on every rank) once the profile is planned.

    The node's agent comes in through two callables (this layer imports nothing of the agent's):
    ``connect()`` returns a new connection to it, greeted (``request(op, **kwargs) -> dict`` and
    ``close(orderly=True)``: a connected :class:`megatron_ft.agent.protocol.AgentClient`), called once
    for the training thread and once per source rank, whose receiver thread has its own;
    ``open_segment(path, writable=..., populate=...)`` maps a slot or block file the agent names
    (:func:`megatron_ft.agent.shm.open_segment`: ``.mm``, ``.array``, ``.size``, ``.close()``).
    Constructing it is collective over :func:`exchange_ranks` (the ranks that make its groups)."""

    def __init__(self, cfg: Any, rank: int, connect: Callable[[], Any], open_segment: Callable[..., Any],
                 last_agreed: Callable[[], int], emit: Optional[Callable[..., None]] = None):
        self.cfg, self.rank = cfg, rank
        self.last_agreed = last_agreed
        self.emit = emit or (lambda *a, **k: None)
        self._open_segment = open_segment
        self.dsts, self.srcs = peers_of(cfg, rank)
        self.members = exchange_ranks(cfg, rank)  # every group this transport makes spans these
        self.backend = dist.get_backend()
        # GPU: NCCL moves device staging buffers (each chunk copied host -> device first); CPU: gloo
        self.device = (torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl"
                       else torch.device("cpu"))
        self._stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None  # GPU only
        self._local = self._counts_agree([])[1]  # whether members may make their groups alone
        self.ctl = self._group("gloo")  # the bubble exchange (training thread)
        self.ctrl = self._group("gloo", CTRL_TIMEOUT)  # headers, tables, byes
        self._groups: dict[int, Any] = {}  # timeout (s) -> data group
        self._agreed: dict[SendSchedule, int] = {}  # schedule agree() returned -> its data group's timeout
        self._data: Any = None  # the data group of the schedule in use, and its timeout
        self._timeout_s = 0
        self._send_buf: Optional[torch.Tensor] = None
        self.failed: Optional[str] = None  # set once the transport broke: it stops for the rest of the run
        self._stopped = False
        self.client = connect()  # the training thread's (pin / unpin)
        # each receiver thread has its own connection: a receiver waiting on its agent (e.g. for a
        # sender's size to be published) must never hold up the training thread's requests
        self._recv_clients = {src: connect() for src in self.srcs}
        self.schedule: Optional[SendSchedule] = None
        #: the link gate (:meth:`use_link`): the training thread reports its network operations to it
        self.gate: Optional[GateClock] = None
        self.label = ""  # the mode in use (use()'s label: a schedule's mode, or "local" / "off" without one)
        self.phase = 0  # transfers start at snapshot steps = phase (mod interval)
        self.current: Optional[_Transfer] = None
        self.last_step = -1
        self.records: list[dict] = []  # one per finished transfer (benchmarks, timeline)
        self.stall_by_mode: dict[str, float] = {}  # training time spent waiting on the transport
        self._ctrl_pending: list = []
        self._gone: set[int] = set()  # sources that said bye or whose receiver stopped (driver thread)
        self._inbox: dict[int, "queue.Queue[_Incoming]"] = {src: queue.Queue() for src in self.srcs}
        self._recv_cpu: dict[int, float] = {}  # source -> its receiver thread's CPU time, once it ended
        self._driver = _Driver(f"mft-sched-p2p-r{rank}", self.device)
        self._receivers = [threading.Thread(target=self._recv_loop, args=(src,), daemon=True,
                                            name=f"mft-sched-recv-r{rank}-from{src}") for src in self.srcs]
        for t in self._receivers:
            t.start()
        log.info("rank %d: scheduled transport, sends to %s, receives from %s", rank, self.dsts, self.srcs)

    def _group(self, backend: str, timeout: Optional[timedelta] = None) -> Any:
        """A new group of :attr:`members` (:func:`member_group`); None when this rank exchanges with nobody."""
        if len(self.members) < 2:
            return None
        return member_group(self.members, lambda: all_exchange_ranks(self.cfg), backend, timeout, self._local)

    def _counts_agree(self, values: list[int]) -> tuple[list[int], bool]:
        """Collective over the job's default group (every rank, no group made for it): the maximum of
        each of ``values`` over the ranks, and whether every rank belongs to equally many process
        groups now (:func:`groups_belonged_to`), so that the members of a group can make it alone.
        Where the counts differ (Megatron puts only some pipeline stages in its embedding groups), each
        rank below the largest makes groups of itself alone (local, no other rank takes part) until it
        belongs to as many: then they agree - rather than every rank making every pair's group, O(R)
        ``new_group`` calls per rank."""
        n = groups_belonged_to()
        t = torch.tensor([*values, n, -n, -1 if n < 0 else 0], dtype=torch.int64).to(self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the default group's backend: NCCL on GPUs
        *out, most, least, unknown = (int(x) for x in t.tolist())
        if unknown == 0 and most != -least and LOCAL_SYNCHRONIZATION:
            for _ in range(most - n):
                dist.new_group(ranks=[self.rank], use_local_synchronization=True, backend="gloo")
            return out, self._counts_agree([])[1]  # every rank the same answer (one all-reduce more)
        return out, unknown == 0 and most == -least

    # ------------------------------------------------------------------ planning (training thread)
    def agree(self, schedule: Optional[SendSchedule]) -> Optional[SendSchedule]:
        """Collective over the job's default group (every rank, no group made for it): every rank
        passes its own schedule; all take the largest interval, so transfers start at the same steps
        everywhere (a ``compare_modes`` rotation switches modes at the same step on every rank), and
        the largest data timeout (:func:`schedule_timeout_s`), whose data group is made here if it is
        new. If one rank has none (it could not plan), nobody sends: None everywhere."""
        (n, missing, timeout_s), self._local = self._counts_agree(
            [schedule.interval_iterations if schedule else 0, 0 if schedule else 1,
             schedule_timeout_s(schedule) if schedule else 0])
        if missing or schedule is None:
            log.error("rank %d: a rank could not plan its checkpoint traffic: no scheduled transfers", self.rank)
            return None
        out = schedule if n == schedule.interval_iterations else dataclasses.replace(schedule, interval_iterations=n)
        self._data_group(timeout_s)
        self._agreed[out] = timeout_s
        return out

    def _data_group(self, timeout_s: int) -> Any:
        """The data group with ``timeout_s``; a new one is made (collective over :attr:`members`) with
        an eager barrier: its communicator is built with every member taking part, before the driver's
        first batch. None when this rank exchanges with nobody."""
        if timeout_s not in self._groups:
            group = self._group(self.backend, timedelta(seconds=timeout_s))
            if group is not None and self.device.type == "cuda":
                dist.barrier(group=group, device_ids=[self.device.index])
            elif group is not None:
                dist.barrier(group=group)
            self._groups[timeout_s] = group
            log.info("rank %d: scheduled transport data group, timeout %d s", self.rank, timeout_s)
        return group

    def use(self, schedule: Optional[SendSchedule], start_step: int, label: str = "") -> None:
        """Run ``schedule`` (one :meth:`agree` returned; None: no transfers) from snapshot step
        ``start_step`` on, after finishing the current transfer (every rank switches at the same step)."""
        self._stalled(self._finish_current())
        if schedule is not None:
            if schedule not in self._agreed:
                raise ValueError("use() takes a schedule agree() returned (agree() makes its data group)")
            self._timeout_s = self._agreed[schedule]
            self._data = self._groups[self._timeout_s]
            if self.device.type == "cuda":  # GPU only: one staging buffer (the driver runs one batch at a time)
                size = max((s.size for s in schedule.sends), default=1)
                if self._send_buf is None or self._send_buf.numel() < size:
                    self._send_buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        self.schedule, self.phase, self.label = schedule, start_step, label or (schedule.mode if schedule else "none")
        if schedule is not None:
            log.info("rank %d: %s schedule, %d sends, a checkpoint every %d iteration(s), data timeout %d s",
                     self.rank, schedule.mode, len(schedule.sends), schedule.interval_iterations, self._timeout_s)

    def use_link(self, bandwidth: float, quiet_s: float) -> GateClock:
        """Make the link gate for a link of ``bandwidth`` bytes/s (training thread, before the first
        :meth:`use` of a gated schedule): schedules with ``gate_window_s`` > 0 send through it.
        ``quiet_s``: after this long without training's network use the link counts as idle (and a
        chunk waits at most twice that for the gate)."""
        self.gate = GateClock(bandwidth, quiet_s, 2 * quiet_s)
        return self.gate

    def exchange_bubbles(self, bubbles: list) -> dict[int, list]:
        """Collective over :attr:`members`: their reserved bubbles ``[(start, end), ...]``, by global
        rank (this rank's own, and those of every rank it sends to; a fixed-size float tensor, no pickle)."""
        cap = 64
        mine = torch.full((cap, 2), -1.0, dtype=torch.float64)
        for i, (a, b) in enumerate(bubbles[:cap]):
            mine[i, 0], mine[i, 1] = a, b
        out = [mine]
        if self.ctl is not None:
            out = [torch.empty_like(mine) for _ in self.members]
            dist.all_gather(out, mine, group=self.ctl)
        return {r: [(float(a), float(b)) for a, b in t.tolist() if a >= 0] for r, t in zip(self.members, out)}

    def ranks_on_my_host(self) -> int:
        """Collective over the job's default group (CPU only: every rank): how many training ranks
        share this rank's host (by host name, exchanged as a 64-bit hash: several simulated nodes on
        one machine share its cores)."""
        mine = torch.tensor([zlib.crc32(socket.gethostname().encode())], dtype=torch.int64).to(self.device)
        out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(out, mine)
        return sum(1 for t in out if int(t.item()) == int(mine.item()))

    # ------------------------------------------------------------------ training thread
    def begin_iteration(self) -> None:
        """Start of an iteration: release its planned chunks to the driver (``blocking``: and wait
        for them). Never raises."""
        self._guard(self._begin_iteration)

    def end_iteration(self, step: int) -> None:
        """After the optimizer step of snapshot step ``step`` (before its snapshot starts): finish
        the transfer that is due and start the next. Never raises."""
        self._guard(self._end_iteration, step)

    def _guard(self, fn: Callable, *args: Any) -> None:
        if self._stopped:
            return
        try:
            if self.failed is None:
                fn(*args)
            if self.failed is not None:  # the driver may have failed in between
                raise RuntimeError(self.failed)
        except Exception as e:  # a broken transport costs the peer copies, never the training
            self.failed = self.failed or str(e)
            self._stop()

    def _stop(self) -> None:
        """The transport broke: stop for good, release the pin, tell the receivers (best effort, not
        waited for). A segment a batch may still touch is left mapped (it goes with the process)."""
        self._stopped = True
        log.error("rank %d: scheduled transport stopped (%s); the peers keep their last complete copy",
                  self.rank, self.failed)
        self.schedule, self.current = None, None
        try:
            self.client.request("sched_unpin", rank=self.rank)
        except Exception:
            pass
        try:
            self._bye()
        except Exception:
            pass

    def _bye(self) -> list:
        bye = torch.tensor([MAGIC, WIRE_VERSION, KIND_BYE, 0, 0, 0, 0, 0], dtype=torch.int64)
        works = [dist.isend(bye, dst, group=self.ctrl, tag=TAG_HEADER) for dst in self.dsts]
        self._ctrl_pending.extend((w, bye) for w in works)
        del self._ctrl_pending[:-MAX_CTRL_PENDING]
        return works

    def _begin_iteration(self) -> None:
        self._reap()
        cur, sch = self.current, self.schedule
        if cur is None or sch is None or cur.iteration >= sch.interval_iterations:
            return
        t0 = time.perf_counter()
        fut = self._release(cur, release_bound(cur.iteration), None if sch.blocking else t0)
        cur.iteration += 1
        if sch.blocking:  # training waits for this iteration's chunks
            fut.result()
            self._reap()
            self._stalled(time.perf_counter() - t0)

    def _end_iteration(self, step: int) -> None:
        self._reap()
        sch = self.schedule
        if sch is None or step < self.phase or (step - self.phase) % sch.interval_iterations:
            return
        t0 = time.perf_counter()
        self._finish_current()
        seg, agreed = self._pin_newest()
        sends = sch.sends if seg is not None else ()
        keys = send_keys([(s.iteration, s.at) for s in sends])
        cur = _Transfer(agreed if seg is not None else -1, seg, step, self._data, self._timeout_s,
                        [(k, self.dsts[s.copy], s.offset, s.size) for s, k in zip(sends, keys)], self._send_buf,
                        gated=sch.gate_window_s > 0 and self.gate is not None)
        self.current = cur
        if seg is not None:
            self.last_step = agreed
        self._announce(cur, sends, keys)
        fut = self._release(cur, release_bound(None), None)
        if sch.blocking:  # "end": the whole checkpoint now, training waits
            fut.result()
            self._reap()
        self._stalled(time.perf_counter() - t0)

    def _pin_newest(self) -> tuple[Any, int]:
        """The slot of the newest agreed step, pinned and mapped read-only; (None, step) when there
        is nothing new to send or the agent would not give it (a checkpoint that cannot start never
        stops training: this rank announces no transfer this time)."""
        agreed = self.last_agreed()
        if agreed < 0 or agreed <= self.last_step:
            return None, agreed
        try:
            info = self.client.request("sched_pin", rank=self.rank, step=agreed)
        except Exception as e:
            log.warning("rank %d: scheduled transfer of step %d not started: %s", self.rank, agreed, e)
            return None, agreed
        try:
            return self._open_segment(info["path"], writable=False, populate=False), agreed  # never written here
        except Exception as e:
            log.warning("rank %d: slot of step %d not readable, transfer not started: %s", self.rank, agreed, e)
            try:
                self.client.request("sched_unpin", rank=self.rank)
            except Exception:
                pass
            return None, agreed

    def _announce(self, cur: _Transfer, sends: tuple, keys: list) -> None:
        """Header (and chunk table) to every destination: each gets one per transfer start, a
        transfer or "none this time", so its driver knows what to receive before any chunk moves."""
        kind = KIND_TRANSFER if cur.seg is not None else KIND_SKIP
        for copy, dst in enumerate(self.dsts):
            rows = [[s.offset, s.size, *k] for s, k in zip(sends, keys) if s.copy == copy]
            length = cur.seg.size if cur.seg is not None else 0
            hdr = torch.tensor([MAGIC, WIRE_VERSION, kind, cur.started_at, cur.step, length, len(rows), TABLE_COLUMNS],
                               dtype=torch.int64)
            cur.ctrl.append((dist.isend(hdr, dst, group=self.ctrl, tag=TAG_HEADER), hdr))
            if rows:
                table = torch.tensor(rows, dtype=torch.int64)
                cur.ctrl.append((dist.isend(table, dst, group=self.ctrl, tag=TAG_TABLE), table))

    def close(self) -> None:
        """Finish the current transfer, stop the driver, then tell the receivers this rank is done."""
        try:
            self._finish_current()
            if self.failed is not None and not self._stopped:  # the driver failed after the last iteration
                self._stop()
            if not self._driver.stop(timeout=60 if self.failed is None else 0.1):
                log.warning("rank %d: the scheduled transport's driver is still busy", self.rank)
            if not self._stopped and self.failed is None:  # a stopped transport said bye already
                for w in self._bye():
                    w.wait(BYE_TIMEOUT)
            for t in self._receivers:
                t.join(timeout=10)
        except Exception as e:
            log.warning("rank %d: scheduled transport did not close cleanly: %s", self.rank, e)
        finally:
            for cl in [self.client, *self._recv_clients.values()]:
                cl.close(orderly=True)

    @property
    def cpu_s(self) -> dict[str, float]:
        """CPU time of the transport's own threads (after :meth:`close`): the driver's jobs (the chunks'
        system calls and their bookkeeping) and the receiver threads (headers, the agent's blocks)."""
        return {"driver": self._driver.cpu_s, "receivers": sum(self._recv_cpu.values())}

    @property
    def stall_s(self) -> float:
        return sum(self.stall_by_mode.values())

    def _stalled(self, seconds: float) -> None:
        self.stall_by_mode[self.label] = self.stall_by_mode.get(self.label, 0.0) + seconds

    def _reap(self, cur: Optional[_Transfer] = None) -> None:
        """Report the chunks sent since the last look (at iteration boundaries, so that a transfer
        spread over iterations shows its chunks as they go: issued .. completed, as the driver saw them)."""
        cur = cur or self.current
        while cur is not None and cur.completed:
            issued, finished, size = cur.completed.popleft()
            self.emit("ckpt-chunk", "ckpt", issued, finished, size, f"step{cur.step}")
            cur.sent += size

    def _release(self, cur: _Transfer, bound: tuple, base: Optional[float]) -> Future:
        fut = self._driver.submit(self._run_release, cur, bound, base)
        cur.releases.append(fut)
        return fut

    def _finish_current(self) -> float:
        """Finish the current transfer (if any); the seconds it took."""
        t0 = time.perf_counter()
        cur, self.current = self.current, None
        if cur is not None:
            self._finish(cur)
        return time.perf_counter() - t0

    def _finish(self, cur: _Transfer) -> None:
        """Release what is left of ``cur``, wait until every chunk moved, then release its slot."""
        t0 = time.perf_counter()
        self._release(cur, END_BOUND, None)
        for fut in cur.releases:
            try:
                fut.result()
            except Exception as e:
                log.warning("rank %d: scheduled transfer started after step %d failed: %s", self.rank,
                            cur.started_at, e)
                break
        waited = time.perf_counter() - t0
        for w, t in cur.ctrl:  # gloo: a work is waited once, and only once it completed
            if w.is_completed():
                w.wait()
            else:  # the peer stopped taking headers
                self._ctrl_pending.append((w, t))
        del self._ctrl_pending[:-MAX_CTRL_PENDING]
        self._reap(cur)
        if cur.seg is None:
            return
        try:
            self.client.request("sched_unpin", rank=self.rank)
        except Exception as e:
            log.warning("rank %d: could not release step %d: %s", self.rank, cur.step, e)
        if self.failed is None:  # else a batch may still read it: it goes with the process
            cur.view = None
            cur.seg.close()
        del self.records[:-MAX_RECORDS]
        self.records.append({"step": cur.step, "bytes": cur.sent, "finish_wait_s": waited, "mode": self.label,
                             "started_after": cur.started_at})

    # ------------------------------------------------------------------ the p2p driver's jobs
    def _run_release(self, cur: _Transfer, bound: tuple, base: Optional[float]) -> None:
        """Driver thread: execute the planned chunks of ``cur`` with keys below ``bound``, in key
        order, each batch at its due time (``base`` + its planned start; None: now)."""
        if self.failed is not None:
            raise RuntimeError(self.failed)
        try:
            if cur.plan is None:
                self._prepare(cur)
            todo = []
            while cur.cursor < len(cur.plan) and cur.plan[cur.cursor].key < bound:
                todo.append(cur.plan[cur.cursor])
                cur.cursor += 1
            ops = [self._op(cur, p, base) for p in todo]
            gate = self.gate if cur.gated else None
            if gate is not None and self._stream is None:  # CPU: sends when the link gate opens
                exchange_gated(cur.group, ops, gate)
                return
            for batch in batch_p2p(ops):
                sending = sum(op.tensor.numel() for op in batch if op.direction == SEND)
                if gate is not None and sending:  # GPU: each batch with a send waits for the gate
                    gate.wait(sending)
                else:
                    clock.pause(min(op.due for op in batch) - time.perf_counter())  # paced: its planned time
                exchange(cur.group, batch, self._stream)
        except Exception as e:  # the peers' streams are out of step with this one now: stop
            self.failed = self.failed or f"transfer started after step {cur.started_at}: {e}"
            log.error("rank %d: %s", self.rank, self.failed)
            raise

    def _prepare(self, cur: _Transfer) -> None:
        """Driver thread: wait for every source's header of ``cur`` (at most the data timeout), then
        plan the transfer's chunks and set up where received chunks land."""
        deadline = time.monotonic() + cur.timeout_s
        incoming: dict[int, _Incoming] = {}
        for src in self.srcs:
            if src in self._gone:
                continue
            try:
                inc = self._inbox[src].get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"rank {src} announced nothing within {cur.timeout_s} s") from None
            if inc.kind == KIND_BYE:
                self._gone.add(src)
                continue
            if inc.start != cur.started_at:
                raise RuntimeError(f"rank {src} announced the transfer started after step {inc.start}, "
                                   f"this one started after step {cur.started_at}: out of step")
            if inc.kind == KIND_TRANSFER:
                incoming[src] = inc
        cur.incoming = incoming
        if cur.seg is not None:  # one view of the slot, sliced per chunk
            with warnings.catch_warnings():  # the mapping is read-only on purpose; torch warns about that
                warnings.simplefilter("ignore", UserWarning)
                cur.view = torch.frombuffer(cur.seg.mm, dtype=torch.uint8)
        cur.plan = plan_transfer(cur.own, {src: inc.rows for src, inc in incoming.items()})
        for inc in incoming.values():
            inc.remaining = len(inc.rows)
            staged = [size for _, off, size in inc.rows if self._stream is not None or not inc.inside(off, size)]
            if staged:  # received one batch at a time: one buffer per source is enough
                inc.stage = torch.empty(max(max(staged), 1), dtype=torch.uint8, device=self.device)
            if inc.remaining == 0:
                inc.done.set()

    def _op(self, cur: _Transfer, p: Planned, base: Optional[float]) -> Op:
        due = 0.0 if base is None else base + max(p.key[1], 0) / 1000.0
        if p.direction == SEND:
            src = cur.view[p.offset: p.offset + p.size]

            def sent(issued: float, finished: float, size: int = p.size) -> None:
                cur.completed.append((issued, finished, size))

            if self._stream is None:  # gloo sends host memory: a window of the pinned slot
                return Op(p.peer, SEND, src, p.key, due, on_done=sent)
            return Op(p.peer, SEND, cur.send_buf[: p.size], p.key, due, host=src, on_done=sent)
        inc = cur.incoming[p.peer]
        window = inc.dst[p.offset: p.offset + p.size] if inc.inside(p.offset, p.size) else None
        if self._stream is None:  # gloo receives into the block's window (or scratch: drained and dropped)
            return Op(p.peer, RECV, window if window is not None else inc.stage[: p.size], p.key, due,
                      on_done=inc.arrived)
        return Op(p.peer, RECV, inc.stage[: p.size], p.key, due, host=window, on_done=inc.arrived)

    # ------------------------------------------------------------------ receiver threads
    def _recv_loop(self, src: int) -> None:
        """Receiver thread of ``src``: each header (and table) it sends, the agent's block for it, the
        transfer handed to the driver; the block closed (and reported complete) once the driver has
        every chunk. Ends at the source's bye, or when the transport stops."""
        inbox = self._inbox[src]
        try:
            while True:
                hdr = torch.empty(HEADER_LEN, dtype=torch.int64)
                dist.recv(hdr, src, group=self.ctrl, tag=TAG_HEADER)
                magic, version, kind, start, step, length, nchunks, columns = (int(x) for x in hdr.tolist())
                if magic != MAGIC or version != WIRE_VERSION or kind not in (KIND_TRANSFER, KIND_BYE, KIND_SKIP):
                    raise ValueError(f"rank {src} sent a header {hdr.tolist()} that is not megatron-ft "
                                     f"scheduled-transport v{WIRE_VERSION}")
                if kind == KIND_BYE:
                    return
                if kind == KIND_SKIP:
                    inbox.put(_Incoming(src, KIND_SKIP, start))
                    continue
                if columns != TABLE_COLUMNS or nchunks < 0:
                    raise ValueError(f"rank {src} sent a chunk table of {nchunks} x {columns}")
                rows = []
                if nchunks:
                    table = torch.empty((nchunks, columns), dtype=torch.int64)
                    dist.recv(table, src, group=self.ctrl, tag=TAG_TABLE)
                    rows = [((it, ms, seq), off, size) for off, size, it, ms, seq in table.tolist()]
                self._receive_transfer(_Incoming(src, KIND_TRANSFER, start, step, length, rows))
                if self._stopped or self.failed is not None:
                    return
        except Exception as e:  # the sender died or the job ends: training is not this thread's business
            log.info("rank %d: receiving from rank %d stopped: %s", self.rank, src, e)
        finally:
            inbox.put(_Incoming(src, KIND_BYE, -1))
            self._recv_cpu[src] = time.thread_time()

    def _receive_transfer(self, inc: _Incoming) -> None:
        """Open the agent's block for ``inc``, hand it to the driver, wait until every chunk landed
        (received even when there is nowhere to put it: the sender's sends must complete)."""
        src, step, length = inc.src, inc.step, inc.length
        try:
            info = self._recv_clients[src].request("sched_recv_begin", src_rank=src, step=step, length=length)
        except Exception as e:
            log.warning("rank %d: agent refused step %d of rank %d: %s", self.rank, step, src, e)
            info = {"ignored": True}
        seg = None
        if not info.get("ignored"):
            try:
                seg = self._open_segment(info["path"], writable=True)  # mapped at once, not a fault per page while chunks land
            except Exception as e:  # received anyway, then dropped
                log.warning("rank %d: block for step %d of rank %d not writable: %s", self.rank, step, src, e)
        inc.dst = torch.from_numpy(seg.array) if seg is not None else None
        self._inbox[src].put(inc)
        while not inc.done.wait(1.0):
            if self.failed is not None or self._stopped:
                return  # a failed batch may still write into the block: it stays mapped, incomplete
        complete = inc.complete
        inc.dst = inc.stage = None
        if seg is None:
            return
        seg.close()
        if complete:
            try:
                self._recv_clients[src].request("sched_recv_done", src_rank=src, step=step)
            except Exception as e:  # the agent restarted: this copy is lost, the next one counts
                log.warning("rank %d: agent did not take step %d of rank %d: %s", self.rank, step, src, e)
        else:
            log.warning("rank %d: transfer of step %d from rank %d covered %d of %d bytes: not complete",
                        self.rank, step, src, sum(size for _, _, size in inc.rows), length)
