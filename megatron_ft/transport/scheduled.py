"""The scheduled transport: trainers send their latest clean snapshot to the peers
that hold its copies, in the chunks and at the times of a :class:`~megatron_ft.schedule.modes.SendSchedule`,
through rotating sub-buffers; the receiving trainer copies each chunk into its agent's shared memory
while the next one arrives, and tells its agent when every chunk is there.

Byte path of one transfer of version ``S`` from rank ``r`` (node A) to rank ``r'`` (same local
index on node B, which holds ``copy.r{r}``)::

    A: agent slot of S (pinned: sched_pin) --(GPU: H2D)--> sub-buffer b --isend--> B: buffer b'
    B: buffer b' --(GPU: D2H)--> agent block copy.r{r}, version S (sched_recv_begin)
    (on CPU the sub-buffers are windows of the slot and of the block: no copies but the kernel's)
    B: after the last chunk: sched_recv_done -> B's agent marks the block complete, announces S

``S`` is the step every rank agreed on (the snapshot engine's ``last_agreed``, read where the engine is
idle), so all ranks send the same version and the group holds a consistent cut. A transfer starts
every ``interval_iterations`` iterations, at the same iteration on every rank; a failure midway
leaves the block incomplete and the previous complete version in use.

Wire format on the transport's own process group (``torch.distributed``: gloo on CPU; NCCL on GPUs,
with device sub-buffers), no pickle: a header of 8 int64 ``[MAGIC, VERSION, kind, step, length,
nchunks, buffers, buffer_bytes]`` (kind 1 = transfer, 2 = bye), then an int64 table of
``nchunks x (offset, size)``, then the chunks in table order.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import socket
import threading
import time
import zlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

import warnings

import numpy as np
import torch
import torch.distributed as dist

from ..agent import shm
from ..agent.protocol import AgentClient
from ..redundancy.exchange import holders_of_whole
from ..redundancy.plan import plan_from_config
from ..schedule.modes import AT_END, Send, SendSchedule

log = logging.getLogger("megatron_ft.transport")

MAGIC = 0x4D4654534348  # "MFTSCH"
WIRE_VERSION = 1
KIND_TRANSFER, KIND_BYE = 1, 2
TAG_HEADER, TAG_TABLE, TAG_CHUNK = 71, 72, 73
GROUP_TIMEOUT = timedelta(hours=24)  # a receiver waits for the next header as long as training runs
BYE_TIMEOUT = timedelta(seconds=30)
MAX_RECORDS = 4096  # per list kept for the run's transport file


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


class _Sent:
    """One started send. gloo's send work must be waited exactly once (a second ``wait`` blocks for
    a completion that never comes), so every wait goes through :meth:`wait`, which remembers the
    outcome (the time it finished, or the error it raised) for the threads that wait later."""

    __slots__ = ("work", "send", "issued", "finished", "reported", "error", "_lock")

    def __init__(self, work: Any, send: Optional[Send], issued: float) -> None:
        self.work, self.send, self.issued, self.finished, self.reported = work, send, issued, 0.0, False
        self.error: Optional[BaseException] = None
        self._lock = threading.Lock()  # the completion thread, the sender (buffer reuse), the training thread

    def wait(self) -> None:
        with self._lock:
            if self.error is not None:
                raise self.error
            if not self.finished:
                try:
                    self.work.wait()
                except BaseException as e:
                    self.error = e
                    raise
                self.finished = time.perf_counter()

    def done(self) -> bool:
        """Finished (waited now if it completed); never blocks."""
        if not self.finished and self.work.is_completed():
            self.wait()
        return bool(self.finished)


@dataclass
class _Transfer:
    step: int
    seg: shm.Segment
    started_at: int  # the snapshot step after which it started
    iteration: int = 0  # next iteration of the schedule to run
    works: list = field(default_factory=list)  # _Sent
    sent: int = 0


class ScheduledTransport:
    """One per trainer rank. The training loop calls :meth:`begin_iteration` at the start of each
    iteration and :meth:`end_iteration` after the optimizer step, before the next snapshot starts
    (the snapshot engine is idle there); :meth:`agree` (collective) and :meth:`use` once the profile
    is planned."""

    def __init__(self, cfg: Any, rank: int, agent_socket: str, hello: dict, last_agreed: Callable[[], int],
                 emit: Optional[Callable[..., None]] = None):
        self.cfg, self.rank = cfg, rank
        self.last_agreed = last_agreed
        self.emit = emit or (lambda *a, **k: None)
        self.dsts, self.srcs = peers_of(cfg, rank)
        backend = dist.get_backend()
        # GPU: NCCL moves device sub-buffers (the chunk is copied host -> device first); CPU: gloo
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.ctl = dist.new_group(backend="gloo")  # planning collectives (main thread)
        self.data = dist.new_group(backend=backend, timeout=GROUP_TIMEOUT)  # chunks (transport threads)
        # headers, tables and byes are small host tensors: gloo (NCCL moves device memory only)
        self.ctrl = self.data if backend == "gloo" else dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)
        self.failed: Optional[str] = None  # set once a send failed: the stream to a peer is out of step
        self.client = AgentClient(agent_socket, cfg.agent.request_timeout_s)  # the training thread's (pin / unpin)
        self.client.connect(hello)
        # each receiver thread has its own connection: a receiver waiting on its agent (e.g. for a
        # sender's size to be published) must never hold up the training thread's requests
        self._recv_clients = {}
        for src in self.srcs:
            self._recv_clients[src] = AgentClient(agent_socket, cfg.agent.request_timeout_s)
            self._recv_clients[src].connect(hello)
        self.schedule: Optional[SendSchedule] = None
        self.label = ""  # the mode in use (use()'s label: a schedule's mode, or "local" / "off" without one)
        self.phase = 0  # transfers start at snapshot steps = phase (mod interval)
        self.current: Optional[_Transfer] = None
        self.last_step = -1
        self.records: list[dict] = []  # one per finished transfer (benchmarks, timeline)
        self.stall_by_mode: dict[str, float] = {}  # training time spent waiting on the transport
        self._bufs: list[torch.Tensor] = []
        self._buf_work: dict[int, Any] = {}
        self._q: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._sender = threading.Thread(target=self._send_loop, name=f"mft-sched-send-r{rank}", daemon=True)
        self._sender.start()
        # waits for each chunk as soon as it is issued, so its end time is when it completed (the
        # timeline's actual chunks), not when the training thread next looked
        self._done_q: "queue.Queue[Optional[_Sent]]" = queue.Queue()
        self._completer = threading.Thread(target=self._complete_loop, name=f"mft-sched-done-r{rank}", daemon=True)
        self._completer.start()
        self._receivers = [threading.Thread(target=self._recv_loop, args=(src,), daemon=True,
                                            name=f"mft-sched-recv-r{rank}-from{src}") for src in self.srcs]
        for t in self._receivers:
            t.start()
        log.info("rank %d: scheduled transport, sends to %s, receives from %s", rank, self.dsts, self.srcs)

    # ------------------------------------------------------------------ planning
    def agree(self, schedule: Optional[SendSchedule]) -> Optional[SendSchedule]:
        """Collective: every rank passes its own schedule; all take the largest interval, so
        transfers start at the same steps everywhere. If one rank has none (it could not plan),
        nobody sends: None everywhere."""
        t = torch.tensor([schedule.interval_iterations if schedule else 0, 0 if schedule else 1], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctl)
        n, missing = (int(x) for x in t.tolist())
        if missing or schedule is None:
            log.error("rank %d: a rank could not plan its checkpoint traffic: no scheduled transfers", self.rank)
            return None
        return schedule if n == schedule.interval_iterations else dataclasses.replace(schedule, interval_iterations=n)

    def use(self, schedule: Optional[SendSchedule], start_step: int, label: str = "") -> None:
        """Run ``schedule`` (an agreed one; None: no transfers) from snapshot step ``start_step`` on,
        after finishing the current transfer (every rank switches at the same step)."""
        self._stalled(self._finish_current())
        if schedule is not None and self.device.type != "cpu":  # GPU: p device sub-buffers of R/p
            self._bufs = [torch.empty(schedule.buffer_bytes, dtype=torch.uint8, device=self.device)
                          for _ in range(schedule.buffers)]
        self.schedule, self.phase, self.label = schedule, start_step, label or (schedule.mode if schedule else "none")
        if schedule is not None:
            log.info("rank %d: %s schedule, %d sends, a checkpoint every %d iteration(s), %d x %d B buffers",
                     self.rank, schedule.mode, len(schedule.sends), schedule.interval_iterations, schedule.buffers,
                     schedule.buffer_bytes)

    def exchange_bubbles(self, bubbles: list) -> dict[int, list]:
        """All ranks' reserved bubbles ``[(start, end), ...]`` (a fixed-size float tensor, no pickle)."""
        cap = 64
        mine = torch.full((cap, 2), -1.0, dtype=torch.float64)
        for i, (a, b) in enumerate(bubbles[:cap]):
            mine[i, 0], mine[i, 1] = a, b
        out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(out, mine, group=self.ctl)
        return {r: [(float(a), float(b)) for a, b in t.tolist() if a >= 0] for r, t in enumerate(out)}

    def ranks_on_my_host(self) -> int:
        """Collective: how many training ranks share this rank's host (by host name, exchanged as a
        64-bit hash: several simulated nodes on one machine share its cores)."""
        mine = torch.tensor([zlib.crc32(socket.gethostname().encode())], dtype=torch.int64)
        out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(out, mine, group=self.ctl)
        return sum(1 for t in out if int(t.item()) == int(mine.item()))

    # ------------------------------------------------------------------ training thread
    def begin_iteration(self) -> None:
        """Start of an iteration: queue (or, blocking, send) its planned chunks. Never raises."""
        if self.failed is None:
            self._guard(self._begin_iteration)

    def end_iteration(self, step: int) -> None:
        """After the optimizer step of snapshot step ``step`` (before its snapshot starts): finish
        the transfer that is due and start the next. Never raises."""
        if self.failed is None:
            self._guard(self._end_iteration, step)

    def _guard(self, fn: Callable, *args: Any) -> None:
        try:
            fn(*args)
            if self.failed is not None:
                raise RuntimeError(self.failed)
        except Exception as e:  # a broken transport costs the peer copies, never the training
            self.failed = self.failed or str(e)
            log.error("rank %d: scheduled transport stopped (%s); the peers keep their last complete copy",
                      self.rank, e)
            self.schedule, self.current = None, None
            try:
                self.client.request("sched_unpin", rank=self.rank)
            except Exception:
                pass

    def _begin_iteration(self) -> None:
        self._reap()
        cur, sch = self.current, self.schedule
        if cur is None or sch is None or cur.iteration >= sch.interval_iterations:
            return
        sends = [s for s in sch.of_iteration(cur.iteration) if s.at != AT_END]
        cur.iteration += 1
        if not sends:
            return
        if sch.blocking:
            t0 = time.perf_counter()
            for s in sends:
                self._issue(cur, s)
            self._wait_works(cur)
            self._stalled(time.perf_counter() - t0)
            return
        now = time.perf_counter()
        for s in sends:
            self._q.put((now + s.at, cur, s))

    def _end_iteration(self, step: int) -> None:
        self._reap()
        sch = self.schedule
        if sch is None or step < self.phase or (step - self.phase) % sch.interval_iterations:
            return
        t0 = time.perf_counter()
        self._finish_current()
        agreed = self.last_agreed()
        if agreed < 0 or agreed <= self.last_step:
            self._stalled(time.perf_counter() - t0)
            return
        try:
            info = self.client.request("sched_pin", rank=self.rank, step=agreed)
        except Exception as e:  # a checkpoint that cannot start never stops training
            log.warning("rank %d: scheduled transfer of step %d not started: %s", self.rank, agreed, e)
            self._stalled(time.perf_counter() - t0)
            return
        try:
            seg = shm.open_segment(info["path"], writable=False, populate=False)  # read-only: never written here
        except Exception:
            self.client.request("sched_unpin", rank=self.rank)
            raise
        cur = _Transfer(agreed, seg, step)
        self.current, self.last_step = cur, agreed
        table = torch.tensor([[s.offset, s.size] for s in sch.sends], dtype=torch.int64)
        for copy, dst in enumerate(self.dsts):
            rows = [i for i, s in enumerate(sch.sends) if s.copy == copy]
            hdr = torch.tensor([MAGIC, WIRE_VERSION, KIND_TRANSFER, agreed, seg.size, len(rows), sch.buffers,
                                sch.buffer_bytes], dtype=torch.int64)
            cur.works.append(_Sent(dist.isend(hdr, dst, group=self.ctrl, tag=TAG_HEADER), None, 0.0))
            cur.works.append(_Sent(dist.isend(table[rows].contiguous(), dst, group=self.ctrl, tag=TAG_TABLE),
                                   None, 0.0))
        at_end = [s for s in sch.of_iteration(0) if s.at == AT_END]
        if at_end:  # "end": the whole checkpoint now, training waits
            cur.iteration = 1
            for s in at_end:
                self._issue(cur, s)
            self._wait_works(cur)
        self._stalled(time.perf_counter() - t0)

    def close(self) -> None:
        """Send what is left of the current transfer, then tell the receivers this rank is done."""
        try:
            self._finish_current()
            self._q.put(None)
            self._sender.join(timeout=60)
            self._done_q.put(None)  # every chunk was waited for above, unless the stream broke (a daemon)
            self._completer.join(timeout=10 if self.failed is None else 0.1)
            if self.failed is None:  # a broken stream cannot carry a bye; the peers' threads are daemons
                bye = torch.tensor([MAGIC, WIRE_VERSION, KIND_BYE, 0, 0, 0, 0, 0], dtype=torch.int64)
                works = [dist.isend(bye, dst, group=self.ctrl, tag=TAG_HEADER) for dst in self.dsts]
                for w in works:
                    w.wait(BYE_TIMEOUT)
            for t in self._receivers:
                t.join(timeout=10)
        except Exception as e:
            log.warning("rank %d: scheduled transport did not close cleanly: %s", self.rank, e)
        finally:
            for cl in [self.client, *self._recv_clients.values()]:
                cl.close(orderly=True)

    @property
    def stall_s(self) -> float:
        return sum(self.stall_by_mode.values())

    def _stalled(self, seconds: float) -> None:
        self.stall_by_mode[self.label] = self.stall_by_mode.get(self.label, 0.0) + seconds

    # ------------------------------------------------------------------ sending
    def _issue(self, cur: _Transfer, s: Send) -> None:
        """Copy one chunk of the pinned slot into its sub-buffer (once that buffer's previous send is
        done: with one buffer every chunk waits for the one before) and start sending it."""
        prev = self._buf_work.pop(s.buffer, None)
        if prev is not None:
            prev.wait()
        with warnings.catch_warnings():  # the mapping is read-only on purpose; torch warns about that
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(cur.seg.mm, dtype=torch.uint8, count=s.size, offset=s.offset)
        if self.device.type == "cpu":
            # gloo sends host memory: sub-buffer b is a window of the pinned slot (no staging copy);
            # at most ``buffers`` chunks are in flight, as with device sub-buffers
            buf = src
        else:  # GPU: NCCL sends device memory - stage the chunk host -> device
            buf = self._bufs[s.buffer][: s.size]
            buf.copy_(src, non_blocking=False)
        t0 = time.perf_counter()
        sent = _Sent(dist.isend(buf, self.dsts[s.copy], group=self.data, tag=TAG_CHUNK), s, t0)
        self._buf_work[s.buffer] = sent
        cur.works.append(sent)
        self._done_q.put(sent)

    def _complete_loop(self) -> None:
        while True:
            sent = self._done_q.get()
            if sent is None:
                return
            try:
                sent.wait()
            except Exception:  # kept in ``sent``: the thread that needs the chunk raises it
                pass

    def _report(self, cur: _Transfer, w: _Sent) -> None:
        if w.send is not None and not w.reported:
            w.reported = True
            self.emit("ckpt-chunk", "ckpt", w.issued, w.finished, w.send.size, f"step{cur.step}")
            cur.sent += w.send.size

    def _reap(self) -> None:
        """Report the chunks that completed since the last look (at iteration boundaries, so that a
        transfer spread over iterations shows its chunks as they go)."""
        cur = self.current
        if cur is not None:
            for w in list(cur.works):
                if w.done():
                    self._report(cur, w)

    def _wait_works(self, cur: _Transfer) -> None:
        try:
            for w in cur.works:
                w.wait()
                self._report(cur, w)
        finally:
            cur.works.clear()
            self._buf_work.clear()

    def _send_loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            due, cur, s = item
            if self.failed is not None:
                self._q.task_done()
                continue
            try:
                delay = due - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                self._issue(cur, s)
            except Exception as e:  # the receiver would take the next chunk for this one: stop the stream
                self.failed = self.failed or f"chunk [{s.offset}, +{s.size}) of step {cur.step} not sent: {e}"
                log.error("rank %d: %s", self.rank, self.failed)
            finally:
                self._q.task_done()

    def _finish_current(self) -> float:
        """Finish the current transfer (if any); the seconds it took."""
        t0 = time.perf_counter()
        cur, self.current = self.current, None
        if cur is not None:
            self._finish(cur)
        return time.perf_counter() - t0

    def _finish(self, cur: _Transfer) -> None:
        """Send what is left of ``cur``, wait until every chunk is sent, then release its slot."""
        sch = self.schedule
        t0 = time.perf_counter()
        if sch is not None:  # the schedule's remaining iterations (a restart shortened them)
            for s in sch.sends:
                if s.iteration >= cur.iteration:
                    self._q.put((0.0, cur, s))
            cur.iteration = sch.interval_iterations
        self._q.join()
        try:
            self._wait_works(cur)
        except Exception as e:
            log.warning("rank %d: scheduled transfer of step %d failed: %s", self.rank, cur.step, e)
        waited = time.perf_counter() - t0
        try:
            self.client.request("sched_unpin", rank=self.rank)
        except Exception as e:
            log.warning("rank %d: could not release step %d: %s", self.rank, cur.step, e)
        cur.seg.close()
        del self.records[:-MAX_RECORDS]
        self.records.append({"step": cur.step, "bytes": cur.sent, "finish_wait_s": waited, "mode": self.label,
                             "started_after": cur.started_at})

    # ------------------------------------------------------------------ receiving
    def _recv_loop(self, src: int) -> None:
        try:
            while True:
                hdr = torch.empty(8, dtype=torch.int64)
                dist.recv(hdr, src, group=self.ctrl, tag=TAG_HEADER)
                magic, version, kind, step, length, nchunks, nbuf, buf_bytes = (int(x) for x in hdr.tolist())
                if magic != MAGIC or version != WIRE_VERSION:
                    raise ValueError(f"rank {src} sent a header {hdr.tolist()} that is not megatron-ft "
                                     f"scheduled-transport v{WIRE_VERSION}")
                if kind == KIND_BYE:
                    return
                table = torch.empty((nchunks, 2), dtype=torch.int64)
                dist.recv(table, src, group=self.ctrl, tag=TAG_TABLE)
                self._receive_transfer(src, step, length, table.tolist(), nbuf, buf_bytes)
        except Exception as e:  # the sender died or the job ends: training is not this thread's business
            log.info("rank %d: receiving from rank %d stopped: %s", self.rank, src, e)

    def _receive_chunks(self, src: int, table: list, nbuf: int, buf_bytes: int, length: int,
                        dst: Optional[np.ndarray]) -> bool:
        """Every chunk of ``table`` (received even when there is nowhere to put it: the sender's
        sends must complete); True when each landed inside ``dst``."""
        inside = [dst is not None and 0 <= off and size >= 0 and off + size <= length for off, size in table]
        direct = self.device.type == "cpu"
        window = max(nbuf, 1)
        need_bufs = not direct or not all(inside)  # GPU staging, or scratch for chunks with nowhere to go
        bufs = [torch.empty(max(buf_bytes, max((sz for _, sz in table), default=1), 1), dtype=torch.uint8,
                            device=self.device) for _ in range(window)] if need_bufs else []

        def post(i: int):
            off, size = table[i]
            if direct and inside[i]:
                target = torch.from_numpy(dst[off: off + size])
            else:
                target = bufs[i % window][:max(size, 0)]
            return dist.irecv(target, src, group=self.data, tag=TAG_CHUNK), target

        pending = [post(i) for i in range(min(window, len(table)))]
        for i, (off, size) in enumerate(table):
            work, target = pending[i]
            pending[i] = None
            work.wait()
            if not direct and inside[i]:
                dst[off: off + size] = target.cpu().numpy()  # GPU: device -> host (shared memory)
            if i + window < len(table):
                pending.append(post(i + window))
        return all(inside)

    def _receive_transfer(self, src: int, step: int, length: int, table: list, nbuf: int, buf_bytes: int) -> None:
        """Receive one transfer, up to ``nbuf`` chunks in flight. GPUs: into ``nbuf`` rotating device
        buffers, chunk i copied into the agent's block (D2H) while chunks i + 1 .. i + nbuf - 1 arrive
        (GEMINI figure 5d). CPU: gloo receives host memory, so the chunks land straight in their
        window of the block (the copy is the kernel's)."""
        try:
            info = self._recv_clients[src].request("sched_recv_begin", src_rank=src, step=step, length=length)
        except Exception as e:
            log.warning("rank %d: agent refused step %d of rank %d: %s", self.rank, step, src, e)
            info = {"ignored": True}
        seg = None
        if not info.get("ignored"):
            try:
                seg = shm.open_segment(info["path"], writable=True, populate=False)
            except Exception as e:  # received anyway (the sender's sends must complete), then dropped
                log.warning("rank %d: block for step %d of rank %d not writable: %s", self.rank, step, src, e)
        try:
            ok = self._receive_chunks(src, table, nbuf, buf_bytes, length, seg.array if seg is not None else None)
        finally:
            if seg is not None:
                seg.close()
        if seg is None:
            return
        covered = sum(size for _, size in table)
        if ok and covered == length:
            try:
                self._recv_clients[src].request("sched_recv_done", src_rank=src, step=step)
            except Exception as e:  # the agent restarted: this copy is lost, the next one counts
                log.warning("rank %d: agent did not take step %d of rank %d: %s", self.rank, step, src, e)
        else:
            log.warning("rank %d: transfer of step %d from rank %d covered %d of %d bytes: not complete",
                        self.rank, step, src, covered, length)
