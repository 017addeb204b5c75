"""The wire's sockets (a part of :mod:`megatron_ft.transport.wire`): private Unix sockets (their
directory, their mode, the caller's uid), TCP connections (opened, tuned, marked with a DiffServ code
point), and an address's name for messages. Imported through :mod:`megatron_ft.transport.wire`."""
from __future__ import annotations

import os
import socket
import struct
from typing import Optional

from .wire_frames import SOCKET_BUFFER, Address


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


def unlink_if_unheard(path: str, kind: int = socket.SOCK_STREAM) -> bool:
    """Remove the Unix socket file ``path`` if nothing listens on it any more (its server was SIGKILLed and
    could not unlink it): a connection is refused there. A live server only sees a connection closed
    before its first request. Whether it was removed."""
    probe = socket.socket(socket.AF_UNIX, kind)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
        return False
    except ConnectionRefusedError:
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False
    except OSError:  # no file, not a socket, a server too busy to queue us: not ours to judge
        return False
    finally:
        probe.close()


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


def describe(address: Address) -> str:
    return address if isinstance(address, str) else f"{address[0]}:{address[1]}"


# ------------------------------------------------------------------------------------ TCP sockets
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
