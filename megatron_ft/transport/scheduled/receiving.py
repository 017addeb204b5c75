"""The scheduled transport's receiving side: one thread per source rank (``mft-sched-recv-r{R}-from{S}``)
that takes each header (and chunk table) the source sends on ``ctrl``, opens the agent's block for the
transfer, hands it to the p2p driver (through :attr:`Receiving.inbox`) and, once the driver has every
chunk, closes the block and tells the agent it is complete. Each thread has its own agent connection: a
receiver waiting on its agent never holds up the training thread's requests."""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from .transfers import (HEADER_LEN, KIND_BYE, KIND_SKIP, KIND_TRANSFER, MAGIC, TABLE_COLUMNS, TAG_HEADER,
                        TAG_TABLE, WIRE_VERSION, _Incoming)

log = logging.getLogger("megatron_ft.transport")


class Receiving:
    """The receiver threads of rank ``rank`` for sources ``srcs`` on group ``ctrl``. ``connect()``: a new
    greeted agent connection (one per source); ``open_segment``: maps the agent's block;
    ``stopped()``: whether the transport stopped or failed (a receiver then leaves a block it waits on
    mapped and incomplete). :attr:`inbox` holds, per source, what it announced, for the driver; a source
    whose thread ended leaves a bye there."""

    def __init__(self, rank: int, srcs: list, ctrl: Any, connect: Callable[[], Any],
                 open_segment: Callable[..., Any], stopped: Callable[[], bool]):
        self.rank, self.ctrl, self._open_segment, self.stopped = rank, ctrl, open_segment, stopped
        self.inbox: dict[int, "queue.Queue[_Incoming]"] = {src: queue.Queue() for src in srcs}
        self.clients = {src: connect() for src in srcs}
        self.cpu: dict[int, float] = {}  # source -> its receiver thread's CPU time, once it ended
        self.threads = [threading.Thread(target=self._loop, args=(src,), daemon=True,
                                         name=f"mft-sched-recv-r{rank}-from{src}") for src in srcs]
        for t in self.threads:
            t.start()

    def join(self, timeout: float) -> None:
        for t in self.threads:
            t.join(timeout=timeout)

    def close(self) -> None:
        for cl in self.clients.values():
            cl.close(orderly=True)

    def _loop(self, src: int) -> None:
        """Receiver thread of ``src``: each header (and table) it sends, the agent's block for it, the
        transfer handed to the driver; the block closed (and reported complete) once the driver has
        every chunk. Ends at the source's bye, or when the transport stops."""
        inbox = self.inbox[src]
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
                self._receive(_Incoming(src, KIND_TRANSFER, start, step, length, rows))
                if self.stopped():
                    return
        except Exception as e:  # the sender died or the job ends: training is not this thread's business
            log.info("rank %d: receiving from rank %d stopped: %s", self.rank, src, e)
        finally:
            inbox.put(_Incoming(src, KIND_BYE, -1))
            self.cpu[src] = time.thread_time()

    def _receive(self, inc: _Incoming) -> None:
        """Open the agent's block for ``inc``, hand it to the driver, wait until every chunk landed
        (received even when there is nowhere to put it: the sender's sends must complete)."""
        src, step, length = inc.src, inc.step, inc.length
        try:
            info = self.clients[src].request("sched_recv_begin", src_rank=src, step=step, length=length)
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
        self.inbox[src].put(inc)
        while not inc.done.wait(1.0):
            if self.stopped():
                return  # a failed batch may still write into the block: it stays mapped, incomplete
        complete = inc.complete
        inc.dst = inc.stage = None
        if seg is None:
            return
        seg.close()
        if complete:
            try:
                self.clients[src].request("sched_recv_done", src_rank=src, step=step)
            except Exception as e:  # the agent restarted: this copy is lost, the next one counts
                log.warning("rank %d: agent did not take step %d of rank %d: %s", self.rank, step, src, e)
        else:
            log.warning("rank %d: transfer of step %d from rank %d covered %d of %d bytes: not complete",
                        self.rank, step, src, sum(size for _, _, size in inc.rows), length)
