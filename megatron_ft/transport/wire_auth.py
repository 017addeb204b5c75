"""The job's credential on the wire (a part of :mod:`megatron_ft.transport.wire`): the HMAC-SHA256
challenge and response that opens a TCP connection, both ways, and :class:`AuthError`. Imported
through :mod:`megatron_ft.transport.wire`."""
from __future__ import annotations

import hashlib
import hmac
import secrets
import socket

from .wire_frames import WireError, recv_frame, send_frame


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
