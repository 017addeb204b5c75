"""Errors that end the whole job at once, never retried by torchrun's restarts.

A trainer that finds protection it was asked for unavailable (no agent, no shared memory for its
slots: ``agent.required: true``) or a configuration error calls :func:`end_job`. It writes the
message to ``<run dir>/node<N>/fatal.json`` (atomically, a versioned JSON record) and exits with
:data:`EXIT_CODE`. Every node's launcher watches the run directory (simulated nodes share it; on a
cluster a shared run directory, else each node's own), stops torchrun and its agent, prints the
message and exits with the same code: an error that would repeat is not retried ``max_restarts``
times.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import sys
from typing import NoReturn, Optional

log = logging.getLogger("megatron_ft")

EXIT_CODE = 2
FORMAT = "megatron-ft-fatal/1"


def record_path(run_dir: str, node: int) -> str:
    return os.path.join(run_dir, f"node{node}", "fatal.json")


def write(run_dir: str, node: int, message: str) -> str:
    """Record that ``node`` ends the job with ``message``; returns the file's path."""
    path = record_path(run_dir, node)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "node": node, "pid": os.getpid(), "message": message}, f)
    os.replace(tmp, path)
    return path


def read(run_dir: str) -> Optional[tuple[int, str]]:
    """(node, message) of the first node that ended the job, or None."""
    for path in sorted(glob.glob(os.path.join(run_dir, "node*", "fatal.json"))):
        try:
            with open(path, encoding="utf-8") as f:
                rec = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and rec.get("format") == FORMAT:
            return int(rec.get("node", -1)), str(rec.get("message", ""))
    return None


def end_job(message: str) -> NoReturn:
    """In a trainer under ``megatron-ft launch``: record ``message`` for the launchers and exit
    with :data:`EXIT_CODE` (outside a launcher: just exit with it, saying why)."""
    run_dir, node = os.environ.get("MFT_RUN_DIR"), os.environ.get("MFT_NODE_RANK")
    if run_dir and node is not None:
        write(run_dir, int(node), message)
    log.error("megatron-ft: %s", message)
    print(f"[megatron-ft] fatal: {message}", file=sys.stderr, flush=True)
    sys.stderr.flush()
    os._exit(EXIT_CODE)  # not SystemExit: no atexit handler or thread may hang the exit
