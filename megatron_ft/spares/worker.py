"""What torchrun starts for each worker when the node keeps warm spares (:mod:`.pool`):
``python -m megatron_ft.spares.worker SCRIPT ARGS...`` (or ``-m MODULE ARGS...``).

It asks the node's pool (``MFT_SPARES_SOCKET``) for a trainer with its own environment, arguments,
working directory and standard streams, then stands in for it: torchrun's signals are forwarded,
and it exits with the trainer's status (a trainer killed by signal N ends this process by the same
signal). Imports only the standard library, so it starts in tens of milliseconds. Without a pool
(none configured, not warm, or gone) it replaces itself with ``python SCRIPT ARGS`` - the cold
start - so a job never depends on the pool.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys

from .pool import FORMAT, MAX_REQUEST

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
        req = {"format": FORMAT, "argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
        socket.send_fds(conn, [json.dumps(req).encode()], [0, 1, 2])
        first = json.loads(conn.recv(MAX_REQUEST) or b"{}")
        int(first["pid"])  # the trainer runs
    except (OSError, ValueError, KeyError):  # the pool is gone or refused: start cold
        conn.close()
        cold(argv)
        return

    def forward(sig: int, _frame: object) -> None:
        try:
            conn.send(json.dumps({"signal": int(sig)}).encode())
        except OSError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    code = 1
    while True:
        try:
            data = conn.recv(MAX_REQUEST)
        except InterruptedError:
            continue
        except OSError:
            data = b""
        if not data:  # the pool died: its trainer died with it
            break
        try:
            msg = json.loads(data)
        except ValueError:
            continue
        if "exit" in msg:
            code = int(msg["exit"])
            break
    if code < 0:  # killed by a signal: end the same way, so torchrun sees what happened to the trainer
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code if code >= 0 else 1)


if __name__ == "__main__":
    main()
