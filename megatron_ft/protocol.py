"""Control messages between trainers and their node's agent.

A frame is a 4-byte big-endian length followed by a UTF-8 JSON object with ``"v": 1`` and
``"op"``. Replies carry ``"ok"`` and, when false, ``"error"``. Only small control data
travels here; snapshot bytes go through shared memory. No pickle.

Operations (request fields -> reply fields):

=========  ==========================================  ======================================
op         request                                     reply
=========  ==========================================  ======================================
hello      rank, local_rank, pid, run_id               node, agent_pid
register   rank, size, fingerprint                     slots: [path, ...], adopted
begin      rank, step                                  slot (index) | ok=false "busy"
commit     rank, slot, step                            -
abort      rank, slot                                  -
global     rank, step (consistent on every rank)       -
invalidate rank, step (found corrupt at restore)       invalidated (bool)
list       rank                                        versions: [{slot, step, state, path}]
status     -                                           table of every rank's versions, persists
persist    step                                        queued (bool)
bye        -                                           - (orderly trainer exit)
shutdown   -                                           - (agent removes its segments and exits)
=========  ==========================================  ======================================
"""
from __future__ import annotations

import json
import socket
import struct
import threading
from typing import Any, Optional

PROTOCOL_VERSION = 1
MAX_FRAME = 16 << 20
_LEN = struct.Struct(">I")


class ProtocolError(RuntimeError):
    pass


class AgentError(RuntimeError):
    """The agent answered ok=false; ``kind`` names the agent-side error class (e.g. SharedMemoryError)."""

    def __init__(self, message: str, kind: str = ""):
        super().__init__(message)
        self.kind = kind


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("peer closed the connection")
        buf += part
    return bytes(buf)


def send_msg(sock: socket.socket, msg: dict) -> None:
    raw = json.dumps({"v": PROTOCOL_VERSION, **msg}, separators=(",", ":")).encode()
    if len(raw) > MAX_FRAME:
        raise ProtocolError(f"message of {len(raw)} bytes exceeds the {MAX_FRAME}-byte limit")
    sock.sendall(_LEN.pack(len(raw)) + raw)


def recv_msg(sock: socket.socket) -> dict:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes exceeds the {MAX_FRAME}-byte limit")
    msg = json.loads(_recv_exact(sock, n))
    if not isinstance(msg, dict) or msg.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported message (protocol v{PROTOCOL_VERSION} expected): {str(msg)[:200]}")
    return msg


class AgentClient:
    """A trainer's connection to its node's agent (thread-safe: one request at a time)."""

    def __init__(self, socket_path: str, timeout: float = 30.0):
        self.socket_path = socket_path
        self.timeout = timeout
        self._sock: Optional[socket.socket] = None
        self._lock = threading.Lock()
        self._hello: Optional[dict] = None

    def connect(self, hello: dict) -> dict:
        with self._lock:
            self._close_locked()
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(self.timeout)
            s.connect(self.socket_path)
            self._sock = s
            self._hello = hello
            return self._request_locked({"op": "hello", **hello})

    def request(self, op: str, **fields: Any) -> dict:
        """Send one request; reconnect once (re-sending hello) if the agent restarted."""
        with self._lock:
            for attempt in (0, 1):
                try:
                    if self._sock is None:
                        if self._hello is None:
                            raise ConnectionError("not connected")
                        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                        s.settimeout(self.timeout)
                        s.connect(self.socket_path)
                        self._sock = s
                        self._request_locked({"op": "hello", **self._hello})
                    return self._request_locked({"op": op, **fields})
                except (ConnectionError, OSError):
                    self._close_locked()
                    if attempt:
                        raise
            raise AssertionError("unreachable")

    def _request_locked(self, msg: dict) -> dict:
        assert self._sock is not None
        send_msg(self._sock, msg)
        reply = recv_msg(self._sock)
        if not reply.get("ok", False):
            raise AgentError(f"agent refused {msg.get('op')}: {reply.get('error', 'no reason given')}",
                             str(reply.get("kind", "")))
        return reply

    def _close_locked(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None

    def close(self, orderly: bool = True) -> None:
        with self._lock:
            if orderly and self._sock is not None:
                try:
                    send_msg(self._sock, {"op": "bye"})
                    recv_msg(self._sock)
                except (ConnectionError, OSError, ProtocolError):
                    pass
            self._close_locked()


MAX_SOCKET_PATH = 107  # sockaddr_un.sun_path on Linux, minus the terminating NUL


def socket_path(socket_dir: str, run_id: str, node: int) -> str:
    path = f"{socket_dir.rstrip('/')}/{run_id}.node{node}.sock"
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise ValueError(f"agent.socket_dir={socket_dir!r} is too long: the agent socket path {path!r} has "
                         f"{len(path.encode())} bytes, Unix sockets allow {MAX_SOCKET_PATH}; use a shorter directory")
    return path
