"""The scheduled transport's wire format on its ``ctrl`` group and its transfer records (no I/O here).

A header of 8 int64 ``[MAGIC, VERSION, kind, start, step, length, nchunks, columns]`` (kind
:data:`KIND_TRANSFER`, :data:`KIND_BYE`, or :data:`KIND_SKIP`: no transfer this time; ``start``: the
iteration step after which the transfer started, the same on every rank), then for a transfer an int64
table of ``nchunks x (offset, size, iteration, at_ms, seq)`` (the chunk's key). No pickle.
:class:`_Incoming` is one announced transfer as its receiver sees it, :class:`_Transfer` one transfer as
its sender runs it.
"""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch

from ..p2p_batch import Planned

MAGIC = 0x4D4654534348  # "MFTSCH"
WIRE_VERSION = 2
KIND_TRANSFER, KIND_BYE, KIND_SKIP = 1, 2, 3
TAG_HEADER, TAG_TABLE, TAG_CHUNK = 71, 72, 73
HEADER_LEN, TABLE_COLUMNS = 8, 5
CTRL_TIMEOUT = timedelta(hours=24)  # a receiver thread waits for the next header as long as training runs
BYE_TIMEOUT = timedelta(seconds=30)
MAX_RECORDS = 4096  # per list kept for the run's transport file
MAX_CTRL_PENDING = 64  # header sends a peer never took (it stopped), kept referenced


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
