"""The scheduled transport's p2p driver: the one thread that touches a data group, the batches it
exchanges in key order (:func:`exchange`; :func:`exchange_gated` through the link gate on gloo), and the
link gate on the clock (:class:`GateClock`)."""
from __future__ import annotations

import logging
import math
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ...schedule.link_gate import LinkGate
from ..p2p_batch import RECV, SEND, Op
from .transfers import TAG_CHUNK

log = logging.getLogger("megatron_ft.transport")

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
