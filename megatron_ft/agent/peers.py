"""Agent-to-agent transport: TCP between the node agents, off the training processes.

A message is a control frame (:mod:`megatron_ft.protocol`: 4-byte length + JSON, ``"v": 1``),
optionally followed by exactly ``nbytes`` raw payload bytes (snapshot data, never pickled).
Payloads are sent from and received into shared-memory mappings (``sendall`` of a memoryview,
``recv_into`` the destination), so the agent adds no copy on either side.

Requests (``op``), each answered by one frame (+ payload for ``get``):

=========  ==================================================  =================================
op         request                                              reply
=========  ==================================================  =================================
put        key, kind, step, length, src, meta + payload        ok
holds      -                                                    primary {rank: [steps]},
                                                                blocks {key: [steps]}, complete
get        what ("primary"|"block"), rank|key, step, lo, hi     ok + payload (hi - lo bytes)
announce   node, step (node holds all its blocks of step)       ok
=========  ==================================================  =================================
"""
from __future__ import annotations

import logging
import socket
import socketserver
import threading
from typing import Any, Callable, Optional

from ..protocol import recv_msg, send_msg

log = logging.getLogger("megatron_ft.agent")

_IO_BLOCK = 8 << 20
SOCKET_BUFFER = 4 << 20  # kernel socket buffers for bulk transfers (the default ~200 KiB stalls loopback)


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:
            pass


def recv_into(sock: socket.socket, dst: memoryview) -> None:
    done, n = 0, len(dst)
    while done < n:
        got = sock.recv_into(dst[done: min(n, done + _IO_BLOCK)])
        if not got:
            raise ConnectionError(f"peer closed the connection with {n - done} payload bytes missing")
        done += got


def discard(sock: socket.socket, n: int) -> None:
    buf = bytearray(min(n, _IO_BLOCK) or 1)
    mv = memoryview(buf)
    while n > 0:
        got = sock.recv_into(mv[: min(n, len(buf))])
        if not got:
            raise ConnectionError("peer closed the connection")
        n -= got


class PeerError(RuntimeError):
    """A peer answered ok=false (the message says why), or could not be reached."""


class PeerClient:
    """One connection to a peer agent (not thread-safe: one per thread and peer)."""

    def __init__(self, addr: tuple[str, int], timeout: float = 30.0):
        self.addr = addr
        self.sock = socket.create_connection(addr, timeout=timeout)
        tune(self.sock)

    def request(self, msg: dict, payload: Optional[memoryview] = None) -> dict:
        if payload is not None:
            msg = {**msg, "nbytes": len(payload)}
        send_msg(self.sock, msg)
        if payload is not None and len(payload):
            self.sock.sendall(payload)
        reply = recv_msg(self.sock)
        if not reply.get("ok"):
            raise PeerError(f"peer {self.addr[0]}:{self.addr[1]} refused {msg.get('op')}: {reply.get('error')}")
        return reply

    def get(self, msg: dict, dst: memoryview) -> dict:
        """``get`` request whose payload lands in ``dst`` (must be exactly hi - lo bytes)."""
        send_msg(self.sock, msg)
        reply = recv_msg(self.sock)
        if not reply.get("ok"):
            raise PeerError(f"peer {self.addr[0]}:{self.addr[1]} cannot serve {msg}: {reply.get('error')}")
        if int(reply.get("nbytes", -1)) != len(dst):
            raise PeerError(f"peer sent {reply.get('nbytes')} bytes, expected {len(dst)}")
        recv_into(self.sock, dst)
        return reply

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class PeerServer:
    """Serves peer requests with ``handler(msg, sock) -> (reply, payload or None)``; for ``put``
    the handler itself reads the ``nbytes`` payload from ``sock`` before replying."""

    def __init__(self, host: str, port: int, handler: Callable[[dict, socket.socket], tuple[dict, Any]]):
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.handler = handler
        self.server = Server((host, port), Handler)
        self.address = self.server.server_address[:2]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                                       name="peer-server", daemon=True)

    def start(self) -> "PeerServer":
        self.thread.start()
        return self

    def _serve(self, sock: socket.socket) -> None:
        tune(sock)
        while True:
            try:
                msg = recv_msg(sock)
            except (ConnectionError, OSError):
                return
            nbytes = int(msg.get("nbytes", 0)) if msg.get("op") == "put" else 0
            try:
                reply, payload = self.handler(msg, sock)
            except Exception as e:  # report, keep serving (the payload may still be unread)
                log.warning("peer request %s failed: %s", msg.get("op"), e)
                if nbytes and not msg.get("_consumed"):
                    try:
                        discard(sock, nbytes)
                    except (ConnectionError, OSError):
                        return
                reply, payload = {"ok": False, "error": f"{type(e).__name__}: {e}"}, None
            try:
                if payload is not None:
                    send_msg(sock, {"ok": True, **reply, "nbytes": len(payload)})
                    sock.sendall(payload)
                else:
                    send_msg(sock, {"ok": True, **reply} if "ok" not in reply else reply)
            except (ConnectionError, OSError):
                return

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
