"""The scheduled transport's receiving side: one thread per source rank (``mft-sched-recv-r{R}-from{S}``)
that takes each header (and chunk table) the source sends on ``ctrl``, opens the source's landing for the
transfer (:class:`AgentBlockLanding`, the peer byte transport's landing interface: the agent's block),
hands it to the p2p driver (through :attr:`Receiving.inbox`) and, once the driver has every chunk, tells
the landing it landed (the agent then counts the block complete). Each thread has its own agent connection: a
receiver waiting on its agent never holds up the training thread's requests."""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..peer_bytes import Buffer
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
        self.rank, self.ctrl, self.stopped = rank, ctrl, stopped
        self.inbox: dict[int, "queue.Queue[_Incoming]"] = {src: queue.Queue() for src in srcs}
        self.clients = {src: connect() for src in srcs}
        #: where each source's copies land (the agent's blocks)
        self.landings = {src: AgentBlockLanding(rank, self.clients[src], open_segment) for src in srcs}
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
        """Open the landing for ``inc``, hand it to the driver, wait until every chunk landed (received
        even when there is nowhere to put it: the sender's sends must complete), then tell the landing."""
        src, landing = inc.src, self.landings[inc.src]
        buffer = Buffer(inc.step, f"copy.r{src}")
        view = landing.open(src, buffer, inc.length)
        inc.dst = torch.frombuffer(view, dtype=torch.uint8) if view is not None and len(view) else None
        self.inbox[src].put(inc)
        while not inc.done.wait(1.0):
            if self.stopped():
                return  # a failed batch may still write into the block: it stays mapped, incomplete
        complete = inc.complete
        inc.dst = inc.stage = None
        if view is None:
            return
        if complete:
            landing.landed(src, buffer)
        else:
            log.warning("rank %d: transfer of step %d from rank %d covered %d of %d bytes: not complete",
                        self.rank, inc.step, src, sum(size for _, _, size in inc.rows), inc.length)
            landing.abandoned(src, buffer)


class AgentBlockLanding:
    """Where one source's copies land: the node agent's block for them (a
    :class:`~megatron_ft.transport.peer_bytes.Landing`). ``open`` asks the agent (``sched_recv_begin``)
    and maps the block it names; ``landed`` unmaps it and tells the agent it is complete
    (``sched_recv_done``); ``abandoned`` unmaps it (the block stays incomplete). An agent that refuses, or a
    block that cannot be mapped, declines the copy (the chunks are received and dropped). ``client``:
    this source's own agent connection; every call comes from that source's receiver thread."""

    def __init__(self, rank: int, client: Any, open_segment: Callable[..., Any]):
        self.rank, self.client, self._open_segment = rank, client, open_segment
        self._seg: Any = None

    def open(self, src: int, buffer: Buffer, length: int) -> Optional[memoryview]:
        try:
            info = self.client.request("sched_recv_begin", src_rank=src, step=buffer.step, length=length)
        except Exception as e:
            log.warning("rank %d: agent refused step %d of rank %d: %s", self.rank, buffer.step, src, e)
            return None
        if info.get("ignored"):
            return None
        try:  # mapped at once, not a fault per page while chunks land
            self._seg = self._open_segment(info["path"], writable=True)
        except Exception as e:  # received anyway, then dropped
            log.warning("rank %d: block for step %d of rank %d not writable: %s", self.rank, buffer.step, src, e)
            return None
        return memoryview(self._seg.array)[:length]

    def landed(self, src: int, buffer: Buffer) -> None:
        self._unmap()
        try:
            self.client.request("sched_recv_done", src_rank=src, step=buffer.step)
        except Exception as e:  # the agent restarted: this copy is lost, the next one counts
            log.warning("rank %d: agent did not take step %d of rank %d: %s", self.rank, buffer.step, src, e)

    def abandoned(self, src: int, buffer: Buffer) -> None:
        self._unmap()

    def _unmap(self) -> None:
        seg, self._seg = self._seg, None
        if seg is not None:
            seg.close()
