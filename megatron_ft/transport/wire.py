"""The wire layer of the agents' connections: a trainer, a launcher or the CLI to its node's agent
(Unix socket) and an agent to its peers (TCP). Framing, versioned messages, the server loop, the
client, the error carried back, and the retry and timeout policy of those connections live here.
The embedded coordination store is served on it too (:mod:`megatron_ft.health.wire_store`), and the
spares' control sockets speak its packet form (:func:`send_packet`, :func:`recv_packet`: the same
versioned object, one per ``SOCK_SEQPACKET`` packet, descriptors passed along;
:mod:`megatron_ft.spares.messages`).

**Frame.** A 4-byte big-endian length, then a UTF-8 JSON object carrying ``"v"`` (this module's
:data:`WIRE_VERSION`) and ``"op"``; a frame whose object has ``"nbytes": N`` is followed by exactly
``N`` raw payload bytes (snapshot data: sent from and received into shared-memory mappings, so the
wire adds no copy). Replies carry ``"ok"``; a refused request carries ``"error"`` (the message),
``"kind"`` (the server-side exception class) and ``"busy"`` (the refusal is temporary). Nothing is
pickled; a frame of another version, or larger than :data:`MAX_FRAME`, is a :class:`WireError`.

**Server.** :class:`Server` runs one thread per connection and hands each request to a
:class:`Handler` with the connection's :class:`Connection` (per-connection state, the request's
payload still on the socket). A handler's exception becomes a refusal and the server keeps serving;
a payload the handler did not read is discarded, so the stream stays in step.

**Client.** :class:`Client` is thread-safe (one request at a time per client). Every blocking socket
operation (connect, each send, each read) is bounded by the client's timeout (from the configuration:
``agent.request_timeout_s``) - not a whole request: a large payload that keeps arriving in reads
takes as long as it takes; a request
that waits on purpose names its wait (``wait_s``), which the server honours and the client adds.
Retry policy, the same for every connection: a connection that breaks (the server restarted) is
re-opened once, re-sending the client's greeting, and the request sent again; a timeout is never
retried (the server may still be working on it) and is raised as ``TimeoutError`` naming the
operation, the address and the limit.

**TCP connections prove the job's secret.** A server given the job's secret (:class:`Server`'s
``secret``; the agents' peer transport and the coordination store) opens every TCP connection with a challenge; the client
(:class:`Client` with the same ``secret``) answers with an HMAC-SHA256 over both sides' nonces, and the
server answers with its own, so each side knows the other holds the secret before any operation
(:func:`answer_challenge`, :func:`check_client`). Until then a frame may be at most
:data:`AUTH_FRAME_MAX` bytes and the exchange must end within :data:`AUTH_TIMEOUT_S`; a client that
fails is logged and disconnected. The payloads' integrity rests on the containers' checksums; traffic
is not encrypted (docs/security.md).

**Local sockets are private.** A Unix socket lives in a directory of mode 0700 owned by the job's
user (:func:`private_directory`; one owned by another user is refused), the socket itself is 0600, and
the server checks every caller's uid (``SO_PEERCRED``, :func:`stranger`): a process of another user
is refused before its first frame is read, even where the permissions were loosened. The spare pool's
socket gets the same treatment (``megatron_ft/spares/pool.py``).

Lock order: a client's lock is the innermost lock of its caller; the server holds no lock while it
reads or writes a socket.

Parts: the frame, the packets and :class:`WireError` are :mod:`.wire_frames`'s, the job's credential
:mod:`.wire_auth`'s, the sockets (private Unix sockets, TCP connections) :mod:`.wire_sockets`'s; this
module holds the server and the client and re-exports the parts' names, so that ``wire.X`` names each.
The settings read when a server or client works (:data:`LISTEN_BACKLOG`, :data:`CONNECT_POLL_S`) are
this module's: set here, they take effect.
"""
from __future__ import annotations

import logging
import socket
import socketserver
import struct
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Union

from ..clock import Deadline
from .wire_auth import AUTH_FRAME_MAX, AUTH_TIMEOUT_S, AuthError, answer_challenge, check_client
from .wire_frames import (_LEN, IO_BLOCK, MAX_FRAME, PACKET_MAX, SOCKET_BUFFER, WIRE_VERSION, Address, FieldTable,
                          WireError, discard, recv_frame, recv_into, recv_packet, send_frame, send_packet)
from .wire_sockets import (_peer, _tune_tcp, bind_private, describe, mark, open_socket, peer_credentials,
                           private_directory, stranger, unlink_if_unheard)

__all__ = [
    # the frame and the packets (wire_frames)
    "WIRE_VERSION", "MAX_FRAME", "IO_BLOCK", "SOCKET_BUFFER", "_LEN", "Address", "WireError", "send_frame",
    "recv_frame", "recv_into", "discard", "PACKET_MAX", "send_packet", "recv_packet", "FieldTable",
    # the job's credential (wire_auth)
    "AUTH_FRAME_MAX", "AUTH_TIMEOUT_S", "AuthError", "check_client", "answer_challenge",
    # the sockets (wire_sockets)
    "private_directory", "bind_private", "peer_credentials", "stranger", "describe", "mark", "open_socket",
    "unlink_if_unheard",
    # the server and the client (here)
    "Reply", "Connection", "Handler", "LISTEN_BACKLOG", "Server", "RemoteError", "CONNECT_POLL_S", "Client",
]

log = logging.getLogger("megatron_ft.wire")


# ---------------------------------------------------------------------------------------- server
@dataclass
class Reply:
    """A handler's answer: ``fields`` of the reply frame, an optional ``payload`` sent after it;
    ``close`` ends the connection after the reply (``orderly`` says the client said goodbye), and
    ``then`` runs on a new thread once the reply is sent (e.g. a shutdown)."""
    fields: dict = field(default_factory=dict)
    payload: Optional[memoryview] = None
    close: bool = False
    orderly: bool = False
    then: Optional[Callable[[], None]] = None


class Connection:
    """The server side of one connection: ``state`` is the handler's, per connection; the current
    request's payload (``nbytes``) is still on the socket until read with :meth:`read_into` or
    :meth:`skip` (the server skips what is left after the handler returns)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.state: dict[str, Any] = {}
        self.orderly = False  # the client ended the connection with a goodbye
        self.unread = 0

    def read_into(self, dst: memoryview) -> None:
        if len(dst) > self.unread:
            raise WireError(f"{len(dst)} payload bytes asked for, {self.unread} announced")
        recv_into(self.sock, dst)
        self.unread -= len(dst)

    def skip(self) -> None:
        n, self.unread = self.unread, 0
        discard(self.sock, n)


class Handler(Protocol):
    def handle(self, conn: Connection, msg: dict) -> Union[Reply, dict]:
        """Answer one request (a dict is the reply's fields); raise to refuse it."""

    def closed(self, conn: Connection) -> None:
        """The connection ended (``conn.orderly`` false: the client vanished without a goodbye)."""


#: connections a server's kernel queue holds before it accepts them (the kernel caps it at
#: net.core.somaxconn): the root's store meets a connection from every node at once after a failover or
#: at a restore - with socketserver's default of 5, a burst's overflow was dropped silently and each such
#: node waited out its timeout
LISTEN_BACKLOG = 4096


class Server:
    """Serves ``handler`` on ``address`` (a Unix path: a stale socket file is replaced; a TCP
    ``(host, port)``, port 0 picks one: see :attr:`address`). ``start()`` serves on a thread,
    ``serve_forever()`` on the caller's; ``close()`` stops accepting and returns."""

    def __init__(self, address: Address, handler: Handler, name: str, secret: Optional[bytes] = None):
        outer = self
        self.handler, self.name, self.secret = handler, name, secret

        class _Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._serve(self.request)

        if isinstance(address, str):
            class _Unix(socketserver.ThreadingUnixStreamServer):
                daemon_threads = True
                request_queue_size = LISTEN_BACKLOG

                def server_bind(self) -> None:  # 0600 in a private directory (a stale socket is replaced)
                    bind_private(self.socket, address)
                    self.server_address = address

            self._server: socketserver.BaseServer = _Unix(address, _Handler)
            self.address: Address = address
        else:
            class _Tcp(socketserver.ThreadingTCPServer):
                daemon_threads = True
                request_queue_size = LISTEN_BACKLOG
                allow_reuse_address = True

            self._server = _Tcp(tuple(address), _Handler)
            self.address = tuple(self._server.server_address[:2])  # type: ignore[assignment]
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "Server":
        self._thread = threading.Thread(target=self.serve_forever, name=self.name, daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        try:
            self._server.serve_forever(poll_interval=0.05)  # close() waits for one poll: an agent ends sooner
        finally:
            self._server.server_close()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _serve(self, sock: socket.socket) -> None:
        if not isinstance(self.address, str):
            _tune_tcp(sock)
            if self.secret is not None:  # nothing is served before the client proved the job's secret
                sock.settimeout(AUTH_TIMEOUT_S)
                try:
                    check_client(sock, self.secret)
                except (AuthError, OSError, struct.error) as e:
                    if not isinstance(e, ConnectionError):  # (a liveness probe connects and leaves)
                        log.warning("%s: refused a connection from %s: %s", self.name, _peer(sock), e)
                    return
                sock.settimeout(None)
        elif (who := stranger(sock)) is not None:  # nothing is read from another user's process
            log.warning("%s: refused a connection from %s", self.name, who)
            return
        conn = Connection(sock)
        try:
            while True:
                try:
                    msg = recv_frame(sock)
                except (ConnectionError, OSError, WireError, ValueError):
                    return
                conn.unread = int(msg.get("nbytes", 0))
                try:
                    out = self.handler.handle(conn, msg)
                    reply = out if isinstance(out, Reply) else Reply(fields=out)
                    fields = {"ok": True, **reply.fields}
                except Exception as e:  # refuse this request, keep serving
                    if not isinstance(e, KeyError):
                        log.debug("%s: request %s refused: %s", self.name, msg.get("op"), e)
                    reply = Reply()
                    fields = {"ok": False, "error": f"{type(e).__name__}: {e}", "kind": type(e).__name__,
                              "busy": bool(getattr(e, "busy", False))}
                try:
                    if conn.unread:
                        conn.skip()
                    send_frame(sock, fields, reply.payload)
                except (ConnectionError, OSError):
                    return
                finally:
                    if reply.then is not None:
                        threading.Thread(target=reply.then, daemon=True).start()
                if reply.close:
                    conn.orderly = reply.orderly
                    return
        finally:
            self.handler.closed(conn)


# ---------------------------------------------------------------------------------------- client
CONNECT_POLL_S = 0.05  # how often Client.connect(wait_s=...) tries again


class RemoteError(RuntimeError):
    """The server refused the request. ``kind`` names the server-side exception class; ``busy``
    says the refusal is temporary (asking again later may succeed)."""

    def __init__(self, message: str, kind: str = "", busy: bool = False):
        super().__init__(message)
        self.kind = kind
        self.busy = busy


class Client:
    """A connection to one server (thread-safe: one request at a time).

    ``address`` may be a callable that resolves the address at each (re)connect (a peer that
    restarted listens elsewhere). ``greeting`` is sent first on every connection (the agent's
    ``hello``); its reply is kept as :attr:`greeted`. ``error`` is the :class:`RemoteError`
    subclass raised for a refusal. The connection opens on the first request or :meth:`connect`;
    over TCP its packets carry ``dscp`` (:func:`mark`; 0: unmarked).
    """

    def __init__(self, address: Union[Address, Callable[[], Address]], timeout: float,
                 greeting: Optional[dict] = None, error: type = RemoteError, reconnects: int = 1,
                 secret: Optional[bytes] = None, dscp: int = 0):
        if not timeout or timeout <= 0:
            raise ValueError(f"timeout={timeout!r}: a positive number of seconds is required")
        self._address = address
        self.timeout = timeout
        self.greeting = greeting
        self.greeted: Optional[dict] = None
        self.error = error
        self.reconnects = reconnects
        self.secret = secret  # a TCP server's challenge is answered with it (None: it asks for none)
        self.dscp = dscp
        self._sock: Optional[socket.socket] = None
        self._lock = threading.Lock()
        self._where = "" if callable(address) else describe(address)  # for messages: the last address used

    def connect(self, greeting: Optional[dict] = None, wait_s: float = 0.0) -> Optional[dict]:
        """(Re)open the connection now, sending ``greeting`` (kept for reconnects); returns its reply.
        ``wait_s``: while nothing listens at the address yet (a server starting or restarting: its
        socket file missing, or the connection refused), try again every :data:`CONNECT_POLL_S` for up
        to this long, then raise what the last try raised."""
        deadline = Deadline(wait_s, f"a server at {self._where}")
        with self._lock:
            if greeting is not None:
                self.greeting = greeting
            while True:
                self._close_locked()
                try:
                    self._open_locked()
                    return self.greeted
                except (FileNotFoundError, ConnectionRefusedError):
                    if deadline.left() < CONNECT_POLL_S:
                        raise
                deadline.pause(CONNECT_POLL_S)

    def request(self, op: str, *, payload: Optional[memoryview] = None, into: Optional[memoryview] = None,
                **fields: Any) -> dict:
        """Send ``{"op": op, **fields}`` (+ ``payload``); return the reply's fields. ``into``: the
        reply's payload lands there and must be exactly its size. A request that waits on purpose
        says how long in its ``wait_s`` field; the call's bound is then the client's timeout plus it."""
        timeout = self.timeout + float(fields["wait_s"]) if "wait_s" in fields else None
        with self._lock:
            for attempt in range(self.reconnects + 1):
                try:
                    if self._sock is None:
                        self._open_locked()
                    return self._exchange_locked({"op": op, **fields}, payload, into, timeout)
                except TimeoutError as e:
                    self._close_locked()
                    raise TimeoutError(f"{op} to {self._where}: no answer within "
                                       f"{timeout or self.timeout:g} s (agent.request_timeout_s)") from e
                except (ConnectionError, OSError):
                    self._close_locked()
                    if attempt == self.reconnects:
                        raise
            raise AssertionError("unreachable")

    def close(self, goodbye: Optional[str] = None) -> None:
        """Close the connection, first sending the op ``goodbye`` (e.g. ``bye``) if given, best effort."""
        with self._lock:
            if goodbye and self._sock is not None:
                try:
                    send_frame(self._sock, {"op": goodbye})
                    recv_frame(self._sock)
                except (ConnectionError, OSError, WireError, ValueError):
                    pass
            self._close_locked()

    def interrupt(self) -> None:
        """From another thread: shut the connection down under a request waiting on it (which then raises
        a ConnectionError), without waiting for the request's lock. The connection is not re-opened by
        the interrupted request."""
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # -- locked helpers
    def _open_locked(self) -> None:
        address = self._address() if callable(self._address) else self._address
        self._where = describe(address)
        self._sock = open_socket(address, self.timeout, self.dscp)
        if self.secret is not None and not isinstance(address, str):
            answer_challenge(self._sock, self.secret)
        if self.greeting is not None:
            self.greeted = self._exchange_locked(self.greeting, None, None, None)

    def _exchange_locked(self, msg: dict, payload: Optional[memoryview], into: Optional[memoryview],
                         timeout: Optional[float]) -> dict:
        sock = self._sock
        assert sock is not None
        if timeout is not None:
            sock.settimeout(timeout)
        try:
            send_frame(sock, msg, payload)
            reply = recv_frame(sock)
            n = int(reply.get("nbytes", 0))
            if n and (into is None or len(into) != n):
                self._close_locked()  # the payload is not read: the stream is out of step
                raise WireError(f"{msg.get('op')}: {n} payload bytes sent back, "
                                f"{'none' if into is None else len(into)} expected")
            if n:
                recv_into(sock, into)  # type: ignore[arg-type]
        finally:
            if timeout is not None and self._sock is not None:
                self._sock.settimeout(self.timeout)
        if not reply.get("ok", False):
            raise self.error(f"{self._where} refused {msg.get('op')}: "
                             f"{reply.get('error', 'no reason given')}", str(reply.get("kind", "")),
                             bool(reply.get("busy", False)))
        if into is not None and not n and len(into):
            raise WireError(f"{msg.get('op')}: no payload sent back, {len(into)} bytes expected")
        return reply

    def _close_locked(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
