"""The wire's bytes (a part of :mod:`megatron_ft.transport.wire`): the frame (a length prefix, a
versioned JSON object, a payload after it), the packet form of the spares' sockets with its field
table, the payload reads, and :class:`WireError`. Imported through :mod:`megatron_ft.transport.wire`."""
from __future__ import annotations

import json
import os
import socket
import struct
from typing import Any, Optional, Union

WIRE_VERSION = 1
MAX_FRAME = 16 << 20
IO_BLOCK = 8 << 20
SOCKET_BUFFER = 4 << 20  # kernel socket buffers for bulk TCP transfers (the default ~200 KiB stalls loopback)
_LEN = struct.Struct(">I")

#: A Unix socket path, or a TCP ``(host, port)``.
Address = Union[str, "tuple[str, int]"]


class WireError(RuntimeError):
    """A frame that breaks the wire format (wrong version, too large, not a JSON object)."""


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
