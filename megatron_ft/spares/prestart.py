"""A process started before it is needed, its imports done, waiting to be told how to run.

A standby machine does not know which node it will become until it claims one; what it then starts
(the node's agent, its torchrun) would each spend a second or more importing torch on a busy host
before doing anything. The standby starts them ahead instead::

    python -m megatron_ft.spares.prestart MODULE [PRELOAD ...]

imports ``PRELOAD`` (modules ``MODULE`` will need), then reads one JSON line on standard input::

    {"format": "megatron-ft-prestart/1", "argv": [...], "env": {...}, "log": "path"}

and runs ``MODULE`` as ``python -m MODULE ARGV...`` would, with ``env`` as its whole environment
(when given) and standard output and error appended to ``log`` (when given). The end of its input
without a line (its launcher ended without a claim) ends it with status 0, having done nothing.

Contracts: JSON only; the caller owns the process (it may kill it at any time before the line);
after the line, standard input is ``/dev/null``. Nothing here knows what ``MODULE`` is.
"""
from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import time
from typing import IO, TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # annotations only: subprocess is imported where a process is started
    import subprocess

FORMAT = "megatron-ft-prestart/1"


def read_start(stream: IO[str]) -> Optional[dict]:
    """The start line from ``stream``, checked; None at the end of input."""
    line = stream.readline()
    if not line:
        return None
    msg = json.loads(line)
    if (not isinstance(msg, dict) or msg.get("format") != FORMAT or not isinstance(msg.get("argv"), list)
            or not isinstance(msg.get("env", {}), dict)):
        raise SystemExit(f"prestart: not a {FORMAT} line: {line[:200]!r}")
    return msg


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit("usage: python -m megatron_ft.spares.prestart MODULE [PRELOAD ...]")
    module, preload = argv[0], argv[1:]
    t0 = time.time()
    for name in preload:
        importlib.import_module(name)
    ready = time.time()
    msg = read_start(sys.stdin)
    if msg is None:
        return 0
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if msg.get("log"):
        fd = os.open(msg["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    if "env" in msg:
        os.environ.clear()
        os.environ.update(msg["env"])
    print(f"[prestart] {module}: pre-started, imports done in {ready - t0:.1f} s, waited "
          f"{time.time() - ready:.1f} s to be needed", file=sys.stderr, flush=True)
    sys.argv = [module, *msg["argv"]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


# ---------------------------------------------------------------------- the launcher's side
def start(module: str, preload: tuple[str, ...] = (), **popen: Any) -> "subprocess.Popen":
    """``module`` started ahead: it imports ``preload`` and waits for :func:`hand_over`; the end of
    its input (the caller gone, or :func:`hand_over` never called) ends it. ``popen``: the rest of
    ``subprocess.Popen``'s arguments (its streams, session, ``preexec_fn``)."""
    import subprocess

    return subprocess.Popen([sys.executable, "-m", "megatron_ft.spares.prestart", module, *preload],
                            stdin=subprocess.PIPE, **popen)


def hand_over(waiting: "subprocess.Popen", argv: list[str], env: Optional[dict] = None,
              log: Optional[str] = None) -> bool:
    """Make a pre-started process run with ``argv`` (and ``env``, ``log``; see the module's
    docstring); False when it is gone (the caller starts the module itself, cold)."""
    if waiting.poll() is not None or waiting.stdin is None or waiting.stdin.closed:
        return False
    msg: dict = {"format": FORMAT, "argv": [str(a) for a in argv]}
    if env is not None:
        msg["env"] = {str(k): str(v) for k, v in env.items()}
    if log is not None:
        msg["log"] = log
    try:
        waiting.stdin.write((json.dumps(msg) + "\n").encode())
        waiting.stdin.close()
        return True
    except OSError:
        waiting.kill()
        waiting.wait()
        return False


def discard(waiting: "subprocess.Popen") -> None:
    """End a pre-started process that was never handed over (one that was runs on as its owner's)."""
    if waiting.poll() is None and waiting.stdin is not None and not waiting.stdin.closed:
        waiting.kill()
        waiting.wait()


if __name__ == "__main__":
    sys.exit(main())
