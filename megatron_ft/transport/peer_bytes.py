"""The peer byte transport: one small interface for moving a named buffer of bytes to a peer.

Bytes reach a peer two ways in megatron-ft: the node agents push their contributions to the group's
members over their authenticated TCP connections (:mod:`.wire_bytes`), and trainers move them over the
job's process groups (gloo on CPU, NCCL on GPU; :mod:`.group_bytes`, the point-to-point form the
scheduled transport plans its chunks on). Both implement :class:`PeerBytes`, and one contract test runs
against each (``tests/unit/test_peer_bytes_contract.py``): the bytes land whole, a peer that dies
mid-transfer, a send past its bound and a refusal each end the send with the same error type.

The contract
------------
* The sending end calls :meth:`PeerBytes.send` with the peer, the buffer's :class:`Buffer` name (its step,
  its key, and ``meta``: a small JSON object the transport carries unread) and the bytes. It returns once
  the peer's :class:`Landing` holds every byte (``landed`` returned), or raises, within ``timeout``:

  ==================  ==============================================================================
  :class:`PeerRefused` the peer's landing declined the buffer (``open`` returned None: e.g. a stale step)
                       or raised (``error`` names why); nothing of it was written
  :class:`PeerLost`    the peer's end went away (its process died, it closed) before the buffer landed
  :class:`PeerTimeout` the bound passed first; the peer may still land the buffer later
  ==================  ==============================================================================

  All three are :class:`PeerBytesError`, naming the peer, the buffer and the bound. ``send`` never retries
  a buffer on its own after the bound; a caller that retries sends the whole buffer again.
* The receiving end owns a :class:`Landing`: the transport calls ``open(src, buffer, length)`` from its
  receiving thread before any byte moves, writes the bytes into the writable view it returns (exactly
  ``length`` bytes), then calls ``landed(src, buffer)``. A buffer cut short (the sender died, the link
  broke) is never ``landed``: the transport calls ``abandoned(src, buffer)`` instead, once it no longer
  writes the view, which may hold part of the buffer (garbage to the landing). Calls for one source come in
  the order it sent; calls for different sources may run at once on different threads.
* :meth:`PeerBytes.close` stops the endpoint within its own bound; a ``send`` after it raises
  :class:`PeerLost`.

Ownership: ``send`` reads ``data`` until it returns (the caller keeps it alive and unchanged); the view
``open`` returns is the landing's, written only until ``landed`` or the transfer's failure.

Worked example: an in-memory landing, as the tests use (the agents' is their block store):

>>> land = MemoryLanding()
>>> view = land.open(3, Buffer(step=5, key="copy.r2"), 4)
>>> view[:] = b"abcd"; land.landed(3, Buffer(step=5, key="copy.r2"))
>>> land.got[(3, 5, "copy.r2")]
b'abcd'
>>> _ = land.open(3, Buffer(step=6, key="copy.r2"), 4); land.abandoned(3, Buffer(step=6, key="copy.r2"))
>>> land.cut
[(3, 6, 'copy.r2')]
>>> MemoryLanding(refuse=True).open(3, Buffer(step=5, key="copy.r2"), 4) is None
True
"""
from __future__ import annotations

import abc
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional, Protocol


@dataclass(frozen=True)
class Buffer:
    """A buffer's name on the peer transport: the snapshot ``step`` it belongs to, its ``key`` (e.g. a
    block of a redundancy group, ``copy.r3``), and ``meta``, a small JSON object the transport carries to
    the landing unread (the agents send the block's kind, length and contributors in it)."""
    step: int
    key: str
    meta: dict = field(default_factory=dict, hash=False, compare=False)

    def __str__(self) -> str:
        return f"{self.key} of step {self.step}"


class PeerBytesError(RuntimeError):
    """A send that did not land: the peer, the buffer and the bound are named in the message."""

    def __init__(self, message: str, peer: int, buffer: Buffer):
        super().__init__(message)
        self.peer, self.buffer = peer, buffer


class PeerRefused(PeerBytesError):
    """The peer's landing declined the buffer (``declined``: it did not want it, e.g. a step it moved
    past) or refused it with an error (the reason in the message)."""

    def __init__(self, message: str, peer: int, buffer: Buffer, declined: bool):
        super().__init__(message, peer, buffer)
        self.declined = declined


class PeerLost(PeerBytesError, ConnectionError):
    """The peer's end went away before the buffer landed."""


class PeerTimeout(PeerBytesError, TimeoutError):
    """The send's bound passed before the buffer landed."""


class Landing(Protocol):
    """The receiving end's owner of the bytes (see the module's contract)."""

    def open(self, src: int, buffer: Buffer, length: int) -> Optional[memoryview]:
        """Where ``length`` bytes of ``buffer`` from ``src`` go (a writable view of that size), or None to
        decline them; raising refuses them with the exception's message."""

    def landed(self, src: int, buffer: Buffer) -> None:
        """Every byte of ``buffer`` from ``src`` is in the view ``open`` gave."""

    def abandoned(self, src: int, buffer: Buffer) -> None:
        """``buffer`` from ``src`` was cut short after ``open``: its view is no longer written."""


class PeerBytes(abc.ABC):
    """One endpoint of a peer byte transport (see the module's contract)."""

    @abc.abstractmethod
    def send(self, peer: int, buffer: Buffer, data: memoryview, timeout: timedelta) -> None:
        """Send ``data`` as ``buffer`` to ``peer``'s landing; return once it landed, or raise a
        :class:`PeerBytesError` within ``timeout``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop this endpoint (bounded); later sends raise :class:`PeerLost`."""


def seconds(timeout: timedelta) -> float:
    """A send's bound in seconds (positive, or ValueError naming it)."""
    s = timeout.total_seconds()
    if not s > 0:
        raise ValueError(f"timeout={timeout!r}: a positive duration is required")
    return s


class MemoryLanding:
    """A landing that keeps what lands in memory (``got``: ``(src, step, key)`` -> bytes; ``cut``: the
    buffers abandoned), or declines everything (``refuse``). For examples and tests; thread-safe."""

    def __init__(self, refuse: bool = False):
        self.refuse = refuse
        self.got: dict[tuple[int, int, str], bytes] = {}
        self.cut: list[tuple[int, int, str]] = []
        self._open: dict[tuple[int, int, str], bytearray] = {}
        self._lock = threading.Lock()

    def open(self, src: int, buffer: Buffer, length: int) -> Optional[memoryview]:
        if self.refuse:
            return None
        buf = bytearray(length)
        with self._lock:
            self._open[(src, buffer.step, buffer.key)] = buf
        return memoryview(buf)

    def landed(self, src: int, buffer: Buffer) -> None:
        with self._lock:
            k = (src, buffer.step, buffer.key)
            self.got[k] = bytes(self._open.pop(k))

    def abandoned(self, src: int, buffer: Buffer) -> None:
        with self._lock:
            k = (src, buffer.step, buffer.key)
            self._open.pop(k, None)
            self.cut.append(k)
