"""What torchrun starts for each worker when the node keeps warm spares (:mod:`.pool`):
``python -m megatron_ft.spares.worker SCRIPT ARGS...`` (or ``-m MODULE ARGS...``).

It asks the node's pool (``MFT_SPARES_SOCKET``) for a trainer with its own environment, arguments,
working directory and standard streams, then stands in for it: torchrun's signals are forwarded,
and it exits with the trainer's status (a trainer killed by signal N ends this process by the same
signal). Imports only the standard library and the wire layer (which needs nothing else), so it
starts in tens of milliseconds; the pool's two replies are checked by :data:`REPLIES`, not pydantic. Without a pool
(none configured, not warm, or gone) it replaces itself with ``python SCRIPT ARGS`` - the cold
start - so a job never depends on the pool.
"""
from __future__ import annotations

import os
import signal
import socket
import sys

from ..transport import wire

#: what the keeper sends its worker (megatron_ft/spares/messages.py has the whole table)
REPLIES = wire.FieldTable("worker", {"started": {"pid": int}, "exited": {"code": int}})
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def cold(argv: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, "-u", *argv])


def main() -> None:
    argv = sys.argv[1:]
    if not argv:
        print("usage: python -m megatron_ft.spares.worker SCRIPT [ARGS...] | -m MODULE [ARGS...]", file=sys.stderr)
        sys.exit(2)
    path = os.environ.get("MFT_SPARES_SOCKET")
    if not path or not os.path.exists(path):
        cold(argv)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(path)
        wire.send_packet(conn, {"op": "spawn", "argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}, (0, 1, 2))
        first, _ = wire.recv_packet(conn, REPLIES)
        if first["op"] != "started":
            raise ValueError(f"the pool answered {first['op']!r}")
    except (OSError, ValueError, wire.WireError):  # the pool is gone or refused: start cold
        conn.close()
        cold(argv)
        return

    def forward(sig: int, _frame: object) -> None:
        try:
            wire.send_packet(conn, {"op": "signal", "signal": int(sig)})
        except OSError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    code = 1
    while True:
        try:
            msg, _ = wire.recv_packet(conn, REPLIES)
        except InterruptedError:
            continue
        except wire.WireError:
            continue
        except OSError:  # the pool died (ConnectionError): its trainer died with it
            break
        if msg["op"] == "exited":
            code = msg["code"]
            break
    if code < 0:  # killed by a signal: end the same way, so torchrun sees what happened to the trainer
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code if code >= 0 else 1)


if __name__ == "__main__":
    main()
