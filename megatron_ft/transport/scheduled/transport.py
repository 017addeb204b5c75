"""The scheduled transport's sending side and its driver's jobs: :class:`ScheduledTransport`, one per
trainer rank (the package's docstring, :mod:`megatron_ft.transport.scheduled`, describes the whole)."""
from __future__ import annotations

import logging
import queue
import time
import warnings
from concurrent.futures import Future
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ... import clock
from ...clock import Deadline
from ...schedule.modes import SendSchedule
from ..p2p_batch import END_BOUND, SEND, RECV, Op, Planned, batch_p2p, plan_transfer, release_bound, send_keys
from .groups import TransportGroups, peers_of
from .p2p import GateClock, _Driver, exchange, exchange_gated
from .receiving import Receiving
from .transfers import (BYE_TIMEOUT, KIND_BYE, KIND_SKIP, KIND_TRANSFER, MAGIC, MAX_CTRL_PENDING, MAX_RECORDS,
                        TABLE_COLUMNS, TAG_HEADER, TAG_TABLE, WIRE_VERSION, _Incoming, _Transfer)

log = logging.getLogger("megatron_ft.transport")


class ScheduledTransport:
    """One per trainer rank. The training loop calls :meth:`begin_iteration` at the start of each
    iteration and :meth:`end_iteration` after the optimizer step, before the next snapshot starts
    (the snapshot engine is idle there); ``groups.agree`` (:class:`~.groups.TransportGroups`, collective: every
    rank, in the same order)
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
        self.backend = dist.get_backend()
        # GPU: NCCL moves device staging buffers (each chunk copied host -> device first); CPU: gloo
        self.device = (torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl"
                       else torch.device("cpu"))
        self._stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None  # GPU only
        #: its groups and planning collectives (agree, exchange_bubbles, ranks_on_my_host: training thread)
        self.groups = TransportGroups(cfg, rank, self.backend, self.device)
        self.ctrl = self.groups.ctrl  # headers, tables, byes
        self._data: Any = None  # the data group of the schedule in use, and its timeout
        self._timeout_s = 0
        self._send_buf: Optional[torch.Tensor] = None
        self.failed: Optional[str] = None  # set once the transport broke: it stops for the rest of the run
        self._stopped = False
        self.client = connect()  # the training thread's (pin / unpin)
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
        self._driver = _Driver(f"mft-sched-p2p-r{rank}", self.device)
        self.receiving = Receiving(rank, self.srcs, self.ctrl, connect, open_segment,
                                   lambda: self._stopped or self.failed is not None)
        log.info("rank %d: scheduled transport, sends to %s, receives from %s", rank, self.dsts, self.srcs)

    # ------------------------------------------------------------------ planning (training thread)
    def use(self, schedule: Optional[SendSchedule], start_step: int, label: str = "") -> None:
        """Run ``schedule`` (one ``groups.agree`` returned; None: no transfers) from snapshot step
        ``start_step`` on, after finishing the current transfer (every rank switches at the same step)."""
        self._stalled(self._finish_current())
        if schedule is not None:
            if schedule not in self.groups.agreed:
                raise ValueError("use() takes a schedule groups.agree() returned (it makes its data group)")
            self._timeout_s = self.groups.agreed[schedule]
            self._data = self.groups.data[self._timeout_s]
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
            self.receiving.join(timeout=10)
        except Exception as e:
            log.warning("rank %d: scheduled transport did not close cleanly: %s", self.rank, e)
        finally:
            self.client.close(orderly=True)
            self.receiving.close()

    @property
    def cpu_s(self) -> dict[str, float]:
        """CPU time of the transport's own threads (after :meth:`close`): the driver's jobs (the chunks'
        system calls and their bookkeeping) and the receiver threads (headers, the agent's blocks)."""
        return {"driver": self._driver.cpu_s, "receivers": sum(self.receiving.cpu.values())}

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
        deadline = Deadline(cur.timeout_s, "the sources' headers")
        incoming: dict[int, _Incoming] = {}
        for src in self.srcs:
            if src in self._gone:
                continue
            try:
                inc = self.receiving.inbox[src].get(timeout=deadline.left())
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
