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
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import socketserver
import struct
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Union

from ..clock import Deadline

log = logging.getLogger("megatron_ft.wire")

WIRE_VERSION = 1
MAX_FRAME = 16 << 20
IO_BLOCK = 8 << 20
SOCKET_BUFFER = 4 << 20  # kernel socket buffers for bulk TCP transfers (the default ~200 KiB stalls loopback)
_LEN = struct.Struct(">I")

#: A Unix socket path, or a TCP ``(host, port)``.
Address = Union[str, "tuple[str, int]"]


class WireError(RuntimeError):
    """A frame that breaks the wire format (wrong version, too large, not a JSON object)."""


# ------------------------------------------------------------------------ the job's credential
AUTH_FRAME_MAX = 1024  # a frame before the peer proved the secret
AUTH_TIMEOUT_S = 5.0  # the whole challenge and response


class AuthError(WireError):
    """The other side did not prove the job's secret."""


def _mac(secret: bytes, role: str, first: str, second: str) -> str:
    return hmac.new(secret, f"megatron-ft/1|{role}|{first}|{second}".encode(), hashlib.sha256).hexdigest()


def _recv_small(sock: socket.socket) -> dict:
    """A frame before authentication: at most :data:`AUTH_FRAME_MAX` bytes, else :class:`AuthError`."""
    try:
        return recv_frame(sock, AUTH_FRAME_MAX)
    except WireError as e:
        raise AuthError(f"before authentication: {e}") from None


def check_client(sock: socket.socket, secret: bytes) -> None:
    """Server side: challenge the client, check its answer, prove the secret back. Raises
    :class:`AuthError` (or ``OSError``) when the client does not prove it; bounded by the socket's timeout."""
    nonce = secrets.token_hex(16)
    send_frame(sock, {"op": "challenge", "nonce": nonce})
    msg = _recv_small(sock)
    theirs = msg.get("nonce")
    if msg.get("op") != "auth" or not isinstance(theirs, str) or not isinstance(msg.get("mac"), str) \
            or not hmac.compare_digest(msg["mac"], _mac(secret, "client", nonce, theirs)):
        raise AuthError("the client did not prove the job's secret")
    send_frame(sock, {"op": "auth", "mac": _mac(secret, "server", theirs, nonce)})


def answer_challenge(sock: socket.socket, secret: bytes) -> None:
    """Client side of :func:`check_client`: answer the server's challenge and check its proof."""
    msg = _recv_small(sock)
    theirs = msg.get("nonce")
    if msg.get("op") != "challenge" or not isinstance(theirs, str):
        raise AuthError(f"the server sent no challenge (it asks for no secret, or is not this job's): {msg.get('op')!r}")
    mine = secrets.token_hex(16)
    send_frame(sock, {"op": "auth", "nonce": mine, "mac": _mac(secret, "client", theirs, mine)})
    try:
        reply = _recv_small(sock)
    except ConnectionError:  # the server hung up on the answer: it holds another secret
        raise AuthError("the server refused this process's answer (the job's secrets differ)") from None
    if not isinstance(reply.get("mac"), str) or not hmac.compare_digest(reply["mac"], _mac(secret, "server", mine, theirs)):
        raise AuthError("the server did not prove the job's secret")


# ---------------------------------------------------------------------------- local sockets
def private_directory(path: str) -> None:
    """Make ``path`` the home of this user's sockets: created with mode 0700 (its parents as the umask
    says). An existing directory must be this process's user's and closed to everyone else: one owned by
    another user, or open to others (``/tmp`` itself, a home directory), is refused with a
    :class:`PermissionError` naming it and the fix; it is never chmod-ed behind the operator's back."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.geteuid():
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to this job's uid {os.geteuid()}: another "
                              f"user could read or replace the sockets in it; set agent.socket_dir to a directory "
                              f"of your own")
    if st.st_mode & 0o077:
        raise PermissionError(f"{path} is open to other users (mode {st.st_mode & 0o7777:o}): they could reach the "
                              f"sockets in it; chmod 700 {path}, or set agent.socket_dir to a new directory (it is "
                              f"created with mode 700)")


def bind_private(sock: socket.socket, path: str, backlog: Optional[int] = None) -> None:
    """Bind Unix socket ``sock`` at ``path`` in a private directory, readable and writable by this user
    only (0600) before anyone can connect: it is bound under a temporary name (and listening, with a
    ``backlog``), then renamed."""
    private_directory(os.path.dirname(path) or ".")
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    sock.bind(tmp)
    os.chmod(tmp, 0o600)
    if backlog is not None:
        sock.listen(backlog)
    os.replace(tmp, path)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of Unix socket ``sock`` (``SO_PEERCRED``)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", creds)
    return pid, uid, gid


def stranger(sock: socket.socket) -> Optional[str]:
    """Who is at the other end of Unix socket ``sock`` when it is not a process of this job's user (a
    message naming its pid and uid); None when it is."""
    pid, uid, _ = peer_credentials(sock)
    return None if uid == os.geteuid() else f"pid {pid} of uid {uid} (this job runs as uid {os.geteuid()})"


class RemoteError(RuntimeError):
    """The server refused the request. ``kind`` names the server-side exception class; ``busy``
    says the refusal is temporary (asking again later may succeed)."""

    def __init__(self, message: str, kind: str = "", busy: bool = False):
        super().__init__(message)
        self.kind = kind
        self.busy = busy


def describe(address: Address) -> str:
    return address if isinstance(address, str) else f"{address[0]}:{address[1]}"


# ---------------------------------------------------------------------------------------- framing
def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("the other side closed the connection")
        buf += part
    return bytes(buf)


def send_frame(sock: socket.socket, msg: dict, payload: Optional[memoryview] = None) -> None:
    """Write one frame (and ``payload`` after it, announced as ``nbytes``)."""
    if payload is not None:
        msg = {**msg, "nbytes": len(payload)}
    raw = json.dumps({"v": WIRE_VERSION, **msg}, separators=(",", ":")).encode()
    if len(raw) > MAX_FRAME:
        raise WireError(f"message of {len(raw)} bytes exceeds the {MAX_FRAME}-byte frame limit")
    sock.sendall(_LEN.pack(len(raw)) + raw)
    if payload is not None and len(payload):
        sock.sendall(payload)


def recv_frame(sock: socket.socket, max_bytes: int = MAX_FRAME) -> dict:
    """Read one frame's object (not its payload: see :func:`recv_into` and :func:`discard`); a frame
    longer than ``max_bytes`` is refused before it is read."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > max_bytes:
        raise WireError(f"frame of {n} bytes exceeds the {max_bytes}-byte limit")
    return _decode(_recv_exact(sock, n))


def _decode(raw: bytes) -> dict:
    try:
        msg = json.loads(raw)
    except ValueError as e:
        raise WireError(f"a frame that is not JSON ({e}): {raw[:200]!r}") from None
    if not isinstance(msg, dict) or msg.get("v") != WIRE_VERSION:
        raise WireError(f"unsupported message (wire version {WIRE_VERSION} expected): {str(msg)[:200]}")
    return msg


# ------------------------------------------------------------------- packets (the spares' sockets)
#: the largest message on a packet socket (a trainer's request: its arguments and environment)
PACKET_MAX = 1 << 20


def send_packet(sock: socket.socket, msg: dict, fds: tuple[int, ...] = ()) -> None:
    """One message as one packet of a ``SOCK_SEQPACKET`` Unix socket (the spares' control sockets, which
    pass standard streams along): the frame's JSON object with the wire version, ``fds`` passed with it
    (``SCM_RIGHTS``). No length prefix: the socket keeps message boundaries."""
    raw = json.dumps({"v": WIRE_VERSION, **msg}, separators=(",", ":")).encode()
    if len(raw) > PACKET_MAX:
        raise WireError(f"message of {len(raw)} bytes exceeds the {PACKET_MAX}-byte packet limit")
    if fds:
        socket.send_fds(sock, [raw], list(fds))
    else:
        sock.send(raw)


class FieldTable:
    """A protocol's table checked with the standard library only (for a process that must start in
    milliseconds, where pydantic's import would cost more than its start): ``ops`` maps each op to its
    fields' types; :meth:`parse` returns the message, or raises ``ValueError`` naming what is wrong.

    >>> FieldTable("worker", {"exited": {"code": int}}).parse({"v": 1, "op": "exited", "code": "1"})
    Traceback (most recent call last):
    ValueError: worker op 'exited': code='1' is invalid: an int is required
    """

    def __init__(self, name: str, ops: dict[str, dict[str, type]]):
        self.name, self.ops = name, ops

    def parse(self, msg: dict) -> dict:
        op = msg.get("op")
        fields = self.ops.get(op) if isinstance(op, str) else None
        if fields is None:
            raise ValueError(f"{self.name} op {op!r} is unknown; allowed: {sorted(self.ops)}")
        for name, kind in fields.items():
            value = msg.get(name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"{self.name} op {op!r}: {name}={value!r} is invalid: an {kind.__name__} is required")
        return msg


def recv_packet(sock: socket.socket, table: Any, max_fds: int = 0) -> tuple[Any, list[int]]:
    """The next packet's message, typed by ``table`` (a :class:`~.messages.Messages`), and the file
    descriptors that came with it (at most ``max_fds``). A closed socket is a ``ConnectionError``; a
    packet that is not this wire's, or a request its table refuses, a :class:`WireError` naming why
    (its descriptors closed)."""
    raw, fds, _, _ = socket.recv_fds(sock, PACKET_MAX + 1, max_fds) if max_fds else (sock.recv(PACKET_MAX + 1), [], 0, 0)
    if not raw:
        raise ConnectionError("the other side closed the connection")
    try:
        if len(raw) > PACKET_MAX:
            raise WireError(f"a packet of more than {PACKET_MAX} bytes")
        try:
            return table.parse(_decode(raw)), list(fds)
        except ValueError as e:
            raise WireError(str(e)) from None
    except WireError:
        for fd in fds:
            os.close(fd)
        raise


def recv_into(sock: socket.socket, dst: memoryview) -> None:
    """Read exactly ``len(dst)`` payload bytes into ``dst``."""
    done, n = 0, len(dst)
    while done < n:
        got = sock.recv_into(dst[done: min(n, done + IO_BLOCK)])
        if not got:
            raise ConnectionError(f"the other side closed the connection with {n - done} payload bytes missing")
        done += got


def discard(sock: socket.socket, n: int) -> None:
    """Read and drop ``n`` payload bytes."""
    buf = memoryview(bytearray(min(n, IO_BLOCK) or 1))
    while n > 0:
        got = sock.recv_into(buf[: min(n, len(buf))])
        if not got:
            raise ConnectionError("the other side closed the connection inside a payload")
        n -= got


def _peer(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "a client that left"


def _tune_tcp(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:
            pass


def mark(sock: socket.socket, dscp: int) -> None:
    """Give the packets ``sock`` sends the DiffServ code point ``dscp`` (0-63; the IPv4 TOS or IPv6
    traffic class byte is ``dscp << 2``), so that a network with traffic classes can queue them apart
    (:attr:`megatron_ft.config.NetworkConfig.replication_dscp`). Needs no privilege."""
    if not 0 <= dscp <= 63:
        raise ValueError(f"dscp {dscp!r}: must be an integer from 0 to 63")
    if sock.family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, dscp << 2)
    else:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, dscp << 2)


def open_socket(address: Address, timeout: float, dscp: int = 0) -> socket.socket:
    """Connect to ``address`` (bounded by ``timeout``, which then bounds every read and write); a TCP
    connection's packets carry ``dscp`` (:func:`mark`) when it is not 0."""
    if isinstance(address, str):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        try:
            s.connect(address)
        except BaseException:
            s.close()
            raise
        return s
    s = socket.create_connection(tuple(address), timeout=timeout)
    _tune_tcp(s)
    if dscp:
        mark(s, dscp)  # before the first byte: the handshake's SYN went unmarked, no data did
    return s


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
