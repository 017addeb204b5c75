"""The peer byte transport on a process group (gloo on CPU; NCCL on GPU through the same calls).

Point-to-point over ``torch.distributed``: the form the scheduled transport's chunks travel in (its
planner orders and batches them for NCCL's single stream; ``megatron_ft/transport/scheduled/``), as one
:class:`~.peer_bytes.PeerBytes` endpoint per rank of ``group``. Every peer is a rank of the group (its
group rank). One receiver thread per source the endpoint is told to expect (``srcs``) lands what that
source sends in the endpoint's :class:`~.peer_bytes.Landing`.

Protocol, per buffer (int64 tensors and raw bytes, no pickle; what goes to the receiver on tag
:data:`TAG_TO`, what comes back on :data:`TAG_BACK`, so that two ranks sending to each other at once never
take one's answer for the other's header):

1. sender -> receiver: the header ``[MAGIC, VERSION, KIND_BUFFER, step, length, name_len]``, then
   ``name_len`` bytes of JSON ``{"key": ..., "meta": {...}}``;
2. receiver -> sender: the verdict ``[MAGIC, VERSION, verdict]`` (:data:`ACCEPT`, :data:`DECLINE`,
   :data:`REFUSE` then the reason as a JSON string's length and bytes) - a declined or refused buffer's
   bytes never travel;
3. sender -> receiver: the ``length`` bytes, received straight into the landing's view;
4. receiver -> sender: ``[MAGIC, VERSION, LANDED]`` once ``landed`` returned.

:meth:`GroupBytes.close` sends each destination it ever sent to a bye header (``KIND_BYE``), which ends
that destination's receiver thread for this source.

Bounds: every wait of a send is ``Work.wait`` with what is left of the send's ``timeout``. A process
group cannot take back an operation it posted: after a timeout or a lost peer, the link to that peer
is spent (its messages could pair with stale ones), so every later send to it raises
:class:`~.peer_bytes.PeerLost` naming the first failure. A receiver thread waits for the next header as
long as the group lives (gloo raises there when the source's process dies).

Sends to one peer are serialized (a lock per peer); sends to different peers may run at once, each on
its own thread.
"""
from __future__ import annotations

import json
import logging
import threading
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..clock import Deadline
from .peer_bytes import Buffer, Landing, PeerBytes, PeerLost, PeerRefused, PeerTimeout, seconds

log = logging.getLogger("megatron_ft.transport")

MAGIC = 0x4D4654425946  # "MFTBYF"
VERSION = 1
TAG_TO, TAG_BACK = 74, 75
KIND_BUFFER, KIND_BYE = 1, 2
ACCEPT, DECLINE, REFUSE, LANDED = 1, 2, 3, 4
HEADER_LEN, VERDICT_LEN = 6, 3
MAX_NAME = 1 << 20  # bytes of a buffer's name and meta
BYE_TIMEOUT = timedelta(seconds=10)


def _json_tensor(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def _bytes_tensor(view: memoryview) -> torch.Tensor:
    return torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(0, dtype=torch.uint8)


class GroupBytes(PeerBytes):
    """The endpoint of this process on ``group`` (every member calls this with its own ``srcs``, the ranks
    whose sends it receives, and its ``landing``). Not collective: each endpoint starts on its own."""

    def __init__(self, group: Any, landing: Landing, srcs: list[int]):
        self.group, self.landing = group, landing
        self.rank = dist.get_rank(group)
        self._locks: dict[int, threading.Lock] = {}
        self._spent: dict[int, str] = {}  # peer -> why its link is spent
        self._sent_to: set[int] = set()
        self._lock = threading.Lock()  # the tables above
        self._closed = False
        self._threads = [threading.Thread(target=self._receive_from, args=(src,), daemon=True,
                                          name=f"mft-bytes-r{self.rank}-from{src}") for src in srcs]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ sending
    def send(self, peer: int, buffer: Buffer, data: memoryview, timeout: timedelta) -> None:
        bound = seconds(timeout)
        deadline = Deadline(bound, f"send of {buffer} to rank {peer}")
        with self._lock:
            if self._closed:
                raise PeerLost(f"send of {buffer} to rank {peer}: this endpoint is closed", peer, buffer)
            lock = self._locks.setdefault(peer, threading.Lock())
        if not lock.acquire(timeout=bound):
            raise PeerTimeout(f"send of {buffer} to rank {peer}: another send to it held the link for "
                              f"{bound:g} s", peer, buffer)
        try:
            with self._lock:
                why = self._spent.get(peer)
                self._sent_to.add(peer)
            if why is not None:
                raise PeerLost(f"send of {buffer} to rank {peer}: the link is spent ({why})", peer, buffer)
            try:
                self._send_locked(peer, buffer, data, deadline, bound)
            except (PeerLost, PeerTimeout) as e:
                with self._lock:
                    self._spent.setdefault(peer, str(e))
                raise
        finally:
            lock.release()

    def _send_locked(self, peer: int, buffer: Buffer, data: memoryview, deadline: Deadline, bound: float) -> None:
        name = _json_tensor({"key": buffer.key, "meta": buffer.meta})
        header = torch.tensor([MAGIC, VERSION, KIND_BUFFER, buffer.step, len(data), name.numel()], dtype=torch.int64)
        self._wait(self.group.send([header], peer, TAG_TO), peer, buffer, deadline, bound, "the header")
        self._wait(self.group.send([name], peer, TAG_TO), peer, buffer, deadline, bound, "the name")
        verdict = self._verdict(peer, buffer, deadline, bound)
        if verdict == DECLINE:
            raise PeerRefused(f"rank {peer} declined {buffer}", peer, buffer, declined=True)
        if verdict == REFUSE:
            n = torch.empty(1, dtype=torch.int64)
            self._wait(self.group.recv([n], peer, TAG_BACK), peer, buffer, deadline, bound, "the refusal")
            reason = torch.empty(int(n.item()), dtype=torch.uint8)
            self._wait(self.group.recv([reason], peer, TAG_BACK), peer, buffer, deadline, bound, "the refusal")
            raise PeerRefused(f"rank {peer} refused {buffer}: {bytes(reason.numpy()).decode(errors='replace')}",
                              peer, buffer, declined=False)
        if len(data):
            self._wait(self.group.send([_bytes_tensor(data)], peer, TAG_TO), peer, buffer, deadline, bound, "the bytes")
        if self._verdict(peer, buffer, deadline, bound) != LANDED:
            raise PeerLost(f"rank {peer} did not confirm {buffer} landed", peer, buffer)

    def _verdict(self, peer: int, buffer: Buffer, deadline: Deadline, bound: float) -> int:
        v = torch.empty(VERDICT_LEN, dtype=torch.int64)
        self._wait(self.group.recv([v], peer, TAG_BACK), peer, buffer, deadline, bound, "its answer")
        magic, version, verdict = (int(x) for x in v.tolist())
        if magic != MAGIC or version != VERSION:
            raise PeerLost(f"rank {peer} answered {v.tolist()}, not megatron-ft peer bytes v{VERSION}", peer, buffer)
        return verdict

    @staticmethod
    def _wait(work: Any, peer: int, buffer: Buffer, deadline: Deadline, bound: float, what: str) -> None:
        left = deadline.left()
        if left <= 0:
            raise PeerTimeout(f"send of {buffer} to rank {peer}: not landed within {bound:g} s", peer, buffer)
        try:
            work.wait(timedelta(seconds=left))
        except RuntimeError as e:
            if deadline.expired() or "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise PeerTimeout(f"send of {buffer} to rank {peer}: not landed within {bound:g} s (waiting for "
                                  f"{what})", peer, buffer) from e
            raise PeerLost(f"send of {buffer} to rank {peer}: the link broke waiting for {what} ({e})",
                           peer, buffer) from e

    # ------------------------------------------------------------------ receiving
    def _receive_from(self, src: int) -> None:
        """Receiver thread of ``src``: each buffer it sends, into the landing, until its bye or the group
        fails."""
        try:
            while True:
                header = torch.empty(HEADER_LEN, dtype=torch.int64)
                self.group.recv([header], src, TAG_TO).wait()
                magic, version, kind, step, length, name_len = (int(x) for x in header.tolist())
                if magic != MAGIC or version != VERSION or kind not in (KIND_BUFFER, KIND_BYE):
                    raise ValueError(f"rank {src} sent {header.tolist()}: not megatron-ft peer bytes v{VERSION}")
                if kind == KIND_BYE:
                    return
                if not 0 <= name_len <= MAX_NAME or length < 0:
                    raise ValueError(f"rank {src} announced a {name_len}-byte name for {length} bytes")
                raw = torch.empty(name_len, dtype=torch.uint8)
                self.group.recv([raw], src, TAG_TO).wait()
                name = json.loads(bytes(raw.numpy()).decode())
                self._receive_one(src, Buffer(step, str(name["key"]), dict(name.get("meta") or {})), length)
        except Exception as e:  # the source died, or the group ends: the sender's side reports it
            log.info("rank %d: receiving peer bytes from rank %d stopped: %s", self.rank, src, e)

    def _receive_one(self, src: int, buffer: Buffer, length: int) -> None:
        try:
            view = self.landing.open(src, buffer, length)
            if view is not None and len(view) != length:
                raise ValueError(f"the landing gave {len(view)} bytes for a {length}-byte buffer")
        except Exception as e:
            reason = _json_tensor(f"{type(e).__name__}: {e}")
            self._answer(src, REFUSE)
            self.group.send([torch.tensor([reason.numel()], dtype=torch.int64)], src, TAG_BACK).wait()
            self.group.send([reason], src, TAG_BACK).wait()
            return
        if view is None:
            self._answer(src, DECLINE)
            return
        try:
            self._answer(src, ACCEPT)
            if length:
                self.group.recv([_bytes_tensor(view)], src, TAG_TO).wait()
        except BaseException:
            self.landing.abandoned(src, buffer)
            raise
        self.landing.landed(src, buffer)
        self._answer(src, LANDED)

    def _answer(self, src: int, verdict: int) -> None:
        self.group.send([torch.tensor([MAGIC, VERSION, verdict], dtype=torch.int64)], src, TAG_BACK).wait()

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        """Tell every destination this endpoint sent to that it is done (bounded by :data:`BYE_TIMEOUT`
        each), then stop; the receiver threads end at their sources' byes (daemon threads otherwise)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            dsts = sorted(self._sent_to - set(self._spent))
        bye = torch.tensor([MAGIC, VERSION, KIND_BYE, -1, 0, 0], dtype=torch.int64)
        for dst in dsts:
            try:
                self.group.send([bye], dst, TAG_TO).wait(BYE_TIMEOUT)
            except RuntimeError as e:
                log.info("rank %d: no bye to rank %d: %s", self.rank, dst, e)

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the receiver threads (each ends at its source's bye); all ended."""
        d = Deadline(timeout, "the receiver threads")
        for t in self._threads:
            t.join(max(0.0, d.left()))
        return not any(t.is_alive() for t in self._threads)
