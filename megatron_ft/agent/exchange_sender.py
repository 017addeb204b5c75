"""The sending side of the peer redundancy: one thread that exchanges each consistent version.

For a version ``S`` the sender pins the local ranks' primary slots of ``S`` and sends this node's
contributions of the group's exchange (:func:`megatron_ft.redundancy.exchange.group_exchange`):
whole containers for copies, byte ranges for XOR pieces, partial RS parities encoded here (zeros
for packets owned elsewhere, this node's packets of a row pre-reduced), straight from shared memory.
A contribution this node holds itself goes to its own block store without the network.

Only the newest requested version is sent: a request arriving while one is sent replaces any
waiting one. A failed exchange is logged and never stops the agent or training.

Threads and locks: :meth:`ExchangeSender.request` is called by the agent (any thread) and takes
``ExchangeSender.lock`` only; the exchange thread sends with no lock held, through the peer byte
transport on the agents' wire (:class:`~megatron_ft.transport.wire_bytes.WireBytes`: its own kept-open
connection per peer, every socket operation bounded by ``agent.request_timeout_s`` and each put by
:func:`send_bound`); ECHECK's encoder thread encodes row r+1 while row r is sent (the codecs release
the GIL).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Optional, Protocol

import numpy as np

from .. import faultpoints
from ..redundancy import exchange as xch
from ..transport.peer_bytes import Buffer, Landing, PeerRefused
from ..transport.wire_bytes import WireBytes

log = logging.getLogger("megatron_ft.agent")


class SenderOwner(Protocol):
    """What the sender needs from its owner (:class:`.redundancy.Redundancy`); every call is made
    by the exchange thread with no lock of the sender held."""
    node: int
    slots: Any  # the node's SlotStore: pin_step(step) -> {rank: SlotRef}, unpin(refs)
    codec: Any  # the group's RS codec, None for copies and XOR
    peers: Any  # the PeerDirectory: wait_sizes() -> {rank: size}, client(node) -> wire.Client
    cfg: Any  # agent.request_timeout_s bounds each socket operation of a send

    def exchange_for(self, sizes: dict[int, int]) -> xch.GroupExchange: ...
    landing: Landing  # where this node's own contributions land (without the network)
    def exchange_started(self, step: int, t0: float) -> None: ...
    def contributions_sent(self, step: int, ex: xch.GroupExchange, nbytes: int, seconds: float) -> None: ...
    def sent(self, step: int, ok: bool) -> None: ...


def _row_id(key: str) -> str:
    """``rs.g0.p1.row3`` -> ``rs.g0.row3`` (the same row of every parity)."""
    head, row = key.rsplit(".row", 1)
    return head.rsplit(".p", 1)[0] + ".row" + row


class _RowPipeline:
    """ECHECK's encode -> send pipeline for one version: this node's rows (reduction groups) in
    sending order; while row i's partial parities are sent, row i+1 is encoded on the encoder
    thread. At most two rows of partials are alive at a time."""

    def __init__(self, sender: "ExchangeSender", contribs: list, slots: dict):
        self.sender, self.slots = sender, slots
        self.rows: list[str] = []  # row id = block key without the parity part
        self.first: dict[str, tuple] = {}
        for c, length in contribs:
            rid = _row_id(c.key)
            if rid not in self.first:
                self.rows.append(rid)
                self.first[rid] = (c, length)
        self.futures: dict[str, Any] = {}

    def _start(self, i: int) -> None:
        if i < len(self.rows) and self.rows[i] not in self.futures:
            c, length = self.first[self.rows[i]]
            self.futures[self.rows[i]] = self.sender.encoder.submit(self.sender.encode_row, c, length, self.slots)

    def partials(self, key: str) -> list:
        i = self.rows.index(_row_id(key))
        self._start(i)
        self._start(i + 1)
        for old in self.rows[:i]:
            self.futures.pop(old, None)
        return self.futures[self.rows[i]].result()


#: the slowest a send may move and still count as moving: a put of N bytes is bounded by the peer
#: connection's timeout plus N at this rate (8 Mbit/s, below any link a job runs on; every socket
#: operation is bounded by that timeout too, so a stalled peer is noticed within it)
SEND_FLOOR_BYTES_PER_S = 1 << 20


def send_bound(request_timeout_s: float, nbytes: int) -> timedelta:
    """The bound on one put of ``nbytes``.

    >>> send_bound(30.0, 64 << 20)
    datetime.timedelta(seconds=94)
    """
    return timedelta(seconds=request_timeout_s + nbytes / SEND_FLOOR_BYTES_PER_S)


def land_here(landing: Landing, node: int, buffer: Buffer, payload: memoryview) -> bool:
    """A contribution this node holds itself: into its own landing without the network. Whether the
    landing took it."""
    view = landing.open(node, buffer, len(payload))
    if view is None:
        return False
    view[:] = payload
    landing.landed(node, buffer)
    return True


class ExchangeSender:
    """Sends ``owner``'s node's contributions; ``owner`` supplies the sizes, the exchange plan, the
    slots (through its agent), connections to peers, the local block store and what follows a send."""

    def __init__(self, owner: SenderOwner):
        self.owner = owner
        self.node = owner.node
        self.lock = threading.Lock()
        self._cv = threading.Condition(self.lock)
        self._pending: Optional[int] = None
        self._stop = threading.Event()
        #: the exchange thread's peer byte transport (its own kept-open connection per peer)
        self.bytes = WireBytes(self.node, lambda n: owner.peers.client(n))
        self.encoder = ThreadPoolExecutor(1, thread_name_prefix="encode")
        self._thread = threading.Thread(target=self._loop, name="exchange", daemon=True)
        self._thread.start()

    def request(self, step: int) -> None:
        """Exchange ``step`` soon (replaces a waiting, older request)."""
        with self.lock:
            self._pending = step
            self._cv.notify_all()

    def drop_newer(self, step: int) -> None:
        """A rewind to ``step``: a waiting request for a newer one is an abandoned future."""
        with self.lock:
            if self._pending is not None and self._pending > step:
                self._pending = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                while self._pending is None and not self._stop.is_set():
                    self._cv.wait(timeout=0.5)
                step, self._pending = self._pending, None
            if step is None:
                continue
            ok = False
            try:
                self.exchange(step)
                ok = True
            except Exception as e:  # a failed exchange never stops the agent or training
                log.error("agent node %d: exchange of step %d failed: %s", self.node, step, e)
            finally:
                self.owner.sent(step, ok)

    def exchange(self, step: int) -> None:
        owner = self.owner
        t0 = time.perf_counter()
        owner.exchange_started(step, t0)
        sizes = owner.peers.wait_sizes()
        ex = owner.exchange_for(sizes)
        meta = {"sizes": {str(r): s for r, s in sizes.items()},
                "codec": owner.codec.descriptor.to_dict() if owner.codec else None}
        slots = owner.slots.pin_step(step)  # rank -> SlotRef (pinned) or KeyError
        sent = 0
        try:
            mine = ex.sent_by(self.node)
            rs = _RowPipeline(self, [(c, ex.block(c.key, c.dst).length) for c in mine if c.kind == xch.RS], slots)
            for c in mine:
                spec = ex.block(c.key, c.dst)
                payload = memoryview(self._payload(c, spec, slots, rs)).cast("B")
                buffer = Buffer(step, c.key, {"kind": c.kind, "length": spec.length,
                                              "expect": len(spec.contributors), **meta})
                if c.dst == self.node:
                    land_here(owner.landing, self.node, buffer, payload)
                else:
                    self._send(c.dst, buffer, payload)
                    faultpoints.reached("mid-exchange", step)
                sent += len(payload)
        finally:
            owner.slots.unpin(slots)
        owner.contributions_sent(step, ex, sent, time.perf_counter() - t0)

    def _send(self, node: int, buffer: Buffer, payload: memoryview) -> None:
        """``payload`` to ``node``'s block store, within :func:`send_bound`; a contribution the peer declined
        (it keeps every version of the block, or the step moved on there) is not an error."""
        try:
            self.bytes.send(node, buffer, payload, send_bound(self.owner.cfg.agent.request_timeout_s, len(payload)))
        except PeerRefused as e:
            if not e.declined:
                raise
            log.info("agent node %d: %s", self.node, e)

    def _payload(self, c: xch.Contribution, spec: xch.BlockSpec, slots: dict, rs: _RowPipeline) -> Any:
        """The bytes of contribution ``c``: a view of the slot (copy, xor), or this node's partial
        parity of its row (rs, from the encode pipeline)."""
        if c.kind in (xch.COPY, xch.XOR):
            (p,) = c.parts
            return memoryview(slots[p.rank].segment.mm)[p.lo:p.hi]
        return rs.partials(spec.key)[c.parity]

    def encode_row(self, c: xch.Contribution, length: int, slots: dict) -> list[np.ndarray]:
        """This node's packets of one row as data shards (the others zero) -> its m partial parities."""
        codec = self.owner.codec
        zero = np.zeros(length, np.uint8)
        data = [zero] * codec.k
        for p in c.parts:
            buf = np.zeros(length, np.uint8)
            buf[: p.hi - p.lo] = np.frombuffer(slots[p.rank].segment.mm, np.uint8, p.hi - p.lo, p.lo)
            data[p.index] = buf
        out = [np.empty(length, np.uint8) for _ in range(codec.m)]
        codec.encode(data, out)
        return out

    def close(self) -> None:
        self._stop.set()
        self.encoder.shutdown(wait=False)
        with self.lock:
            self._cv.notify_all()
        self.bytes.close()
