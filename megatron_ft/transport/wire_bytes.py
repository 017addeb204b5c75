"""The peer byte transport on the agents' wire (:mod:`.wire`): TCP connections that prove the job's secret.

The sending end, :class:`WireBytes`, keeps one connection per peer and sends each buffer as one ``put``
request, its bytes as the frame's payload (sent straight from the caller's memory: the agents send from
their shared-memory slots). The receiving end is a :class:`~.wire.Server` whose handler passes each ``put``
to :func:`land` with its :class:`~.peer_bytes.Landing`: the agents' peer server does that for its
``put`` requests (``megatron_ft/agent/redundancy.py``), :class:`WireEndpoint` for a server of its own.
The landing's view is filled straight off the socket (no copy in between).

Protocol (the frame's JSON; :data:`PUT_MESSAGES`): ``put`` with ``step``, ``key``, ``src`` (the sender's
node), ``meta`` (the buffer's JSON object) and ``nbytes`` of payload; the reply is ``{"landed": true}``, or
``{"declined": true}`` (the landing did not want it; the payload was read and dropped), or a refusal (the
landing raised: the reason in the reply's ``error``).

Bounds: every socket operation is bounded by the connection's ``request_timeout_s``, and the whole send by
its ``timeout``: when that passes, the endpoint's one watchdog thread shuts the connection down under the
send (:meth:`.wire.Client.interrupt`), which raises :class:`~.peer_bytes.PeerTimeout`. A connection that
broke (the peer restarted) is opened again once within the bound, and the buffer sent again. Threads: one send at a time per peer (the
connection's lock); sends to different peers may run at once.

Worked example: node 0 sends a buffer to a receiving end on this machine, then one its landing declines:

>>> from datetime import timedelta
>>> from megatron_ft.transport.peer_bytes import Buffer, MemoryLanding
>>> secret = b"the job's secret, 32 bytes long."
>>> landing = MemoryLanding()
>>> end = WireEndpoint(landing, secret)
>>> sender = WireBytes(0, connector(lambda peer: end.address, 5.0, secret))
>>> sender.send(1, Buffer(7, "copy.r3"), memoryview(b"snapshot bytes"), timedelta(seconds=5))
>>> landing.got
{(0, 7, 'copy.r3'): b'snapshot bytes'}
>>> landing.refuse = True
>>> sender.send(1, Buffer(8, "copy.r3"), memoryview(b"newer bytes"), timedelta(seconds=5))
Traceback (most recent call last):
...
megatron_ft.transport.peer_bytes.PeerRefused: node 1 declined copy.r3 of step 8
>>> sender.close(); end.close()
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Callable, Optional

from pydantic import StrictStr

from ..clock import Deadline
from . import wire
from .messages import Messages, Node, Request, Step
from .peer_bytes import Buffer, Landing, PeerBytes, PeerLost, PeerRefused, PeerTimeout, seconds


class PutBytes(Request):
    """A buffer for the receiving end's landing (``nbytes`` of payload follow the frame)."""
    step: Step
    key: StrictStr
    src: Node
    meta: dict


#: the wire form of the peer byte transport (the agents' peer protocol includes it)
PUT_MESSAGES = Messages("peer bytes", {"put": PutBytes})


def land(conn: wire.Connection, req: PutBytes, landing: Landing) -> dict:
    """Receive one ``put`` (its payload still on ``conn``) into ``landing``; the reply's fields. A landing
    that raises refuses the put (the server replies with its message and discards the payload)."""
    buffer = Buffer(req.step, req.key, req.meta)
    view = landing.open(req.src, buffer, req.nbytes)
    if view is None:
        conn.skip()
        return {"declined": True}
    if len(view) != req.nbytes:
        raise ValueError(f"the landing of {buffer} gave {len(view)} bytes for a {req.nbytes}-byte buffer")
    try:
        conn.read_into(view)
    except BaseException:
        landing.abandoned(req.src, buffer)
        raise
    landing.landed(req.src, buffer)
    return {"landed": True}


class _Watchdog:
    """Bounds whole sends without a thread per send: :meth:`arm` registers a client with a deadline
    (``time.monotonic()``), :meth:`disarm` takes it back; one daemon thread, started at the first
    :meth:`arm`, shuts a client's connection down under its send once its deadline passed
    (:meth:`.wire.Client.interrupt`). ``_cond``'s lock is held only around the table."""

    def __init__(self, name: str):
        self.name = name
        self._armed: dict[int, tuple[float, wire.Client]] = {}
        self._next = 0
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._stopped = False

    def arm(self, client: wire.Client, seconds: float) -> int:
        with self._cond:
            self._next += 1
            self._armed[self._next] = (time.monotonic() + seconds, client)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify()
            return self._next

    def disarm(self, token: int) -> None:
        with self._cond:
            self._armed.pop(token, None)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._stopped:
                now = time.monotonic()
                for token, (at, client) in list(self._armed.items()):
                    if at <= now:
                        del self._armed[token]
                        client.interrupt()
                soonest = min((at for at, _ in self._armed.values()), default=None)
                self._cond.wait(None if soonest is None else max(0.0, soonest - now))


class WireBytes(PeerBytes):
    """The sending end on node ``node``: ``connect(peer)`` opens a :class:`.wire.Client` to ``peer``'s
    server (its address, the job's secret, ``request_timeout_s``; made once per peer and kept)."""

    def __init__(self, node: int, connect: Callable[[int], wire.Client]):
        self.node = node
        self._connect = connect
        self._clients: dict[int, wire.Client] = {}
        self._lock = threading.Lock()  # the client table only
        self._closed = False
        self._watchdog = _Watchdog(f"peer-bytes-n{node}-bounds")

    def _client(self, peer: int, buffer: Buffer) -> wire.Client:
        with self._lock:
            if self._closed:
                raise PeerLost(f"send of {buffer} to node {peer}: this endpoint is closed", peer, buffer)
            cl = self._clients.get(peer)
            if cl is None:
                cl = self._clients[peer] = self._connect(peer)
                cl.reconnects = 0  # send() retries itself, within its bound
            return cl

    def send(self, peer: int, buffer: Buffer, data: memoryview, timeout: timedelta) -> None:
        bound = seconds(timeout)
        deadline = Deadline(bound, f"send of {buffer} to node {peer}")
        cl = self._client(peer, buffer)
        req = PutBytes(op="put", step=buffer.step, key=buffer.key, src=self.node, meta=buffer.meta)
        token = self._watchdog.arm(cl, bound)
        try:
            for attempt in (0, 1):
                try:
                    reply = cl.request(**req.fields(), payload=data)
                    break
                except wire.RemoteError as e:
                    raise PeerRefused(f"node {peer} refused {buffer}: {e}", peer, buffer, declined=False) from e
                except TimeoutError as e:
                    raise PeerTimeout(f"send of {buffer} to node {peer}: not landed within {bound:g} s ({e})",
                                      peer, buffer) from e
                except (ConnectionError, OSError, wire.WireError) as e:
                    if deadline.expired():
                        raise PeerTimeout(f"send of {buffer} to node {peer}: not landed within {bound:g} s",
                                          peer, buffer) from e
                    if attempt:
                        raise PeerLost(f"send of {buffer} to node {peer}: the connection broke ({e})",
                                       peer, buffer) from e
        finally:
            self._watchdog.disarm(token)
        if reply.get("declined"):
            raise PeerRefused(f"node {peer} declined {buffer}", peer, buffer, declined=True)

    def close(self) -> None:
        self._watchdog.stop()
        with self._lock:
            self._closed = True
            clients, self._clients = list(self._clients.values()), {}
        for cl in clients:
            cl.close()


class WireEndpoint:
    """A receiving end of its own: a TCP server on ``host`` (a free port: :attr:`address`) that lands every
    ``put`` in ``landing``, proving ``secret`` on each connection. :meth:`wait_idle` waits until every
    sender that sent it a buffer has gone; ``close()`` stops it."""

    def __init__(self, landing: Landing, secret: bytes, host: str = "127.0.0.1", name: str = "peer-bytes"):
        self.landing = landing
        self._senders: set[int] = set()  # connections that sent a buffer and are still open
        self._cond = threading.Condition()
        self.server = wire.Server((host, 0), self, name, secret=secret).start()
        self.address = self.server.address

    def handle(self, conn: wire.Connection, msg: dict) -> dict:
        with self._cond:
            self._senders.add(id(conn))
        req = PUT_MESSAGES.parse(msg)
        assert isinstance(req, PutBytes)
        return land(conn, req, self.landing)

    def closed(self, conn: wire.Connection) -> None:
        with self._cond:
            self._senders.discard(id(conn))
            self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` until no sender's connection is open (each one's last buffer landed or
        abandoned); whether none is."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._senders, timeout)

    def close(self) -> None:
        self.server.close()


def connector(address_of: Callable[[int], wire.Address], timeout_s: float, secret: Optional[bytes],
              dscp: int = 0, error: type = wire.RemoteError) -> Callable[[int], wire.Client]:
    """``connect(peer)`` for :class:`WireBytes`: a client to the address ``address_of(peer)`` gives at each
    (re)connect (a restarted peer listens elsewhere)."""
    def connect(peer: int) -> wire.Client:
        return wire.Client(lambda: address_of(peer), timeout_s, error=error, secret=secret, dscp=dscp)
    return connect
