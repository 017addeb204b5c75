"""Errors that end the whole job at once, never retried by torchrun's restarts.

A trainer that finds protection it was asked for unavailable (no agent, no shared memory for its
slots: ``agent.required: true``) or a configuration error calls :func:`end_job`. It writes the
message to ``<run dir>/node<N>/fatal.json`` (atomically, a versioned JSON record) and exits with
its code: :data:`EXIT_CODE`, or the guard's when restores rolled back more often than allowed
(:data:`EXIT_ROLLBACKS_EXHAUSTED`). The node's launcher reads its own node's record (one file, every
0.2 s) and puts it into the job's store as ``fatal/<node>`` (:func:`store_value`), where the root's
job record carries it to every other launcher (``megatron_ft.health.job_record``: a watch, no scan of
the run directory); each stops torchrun and its agent, prints the message and exits with the recorded
code: an error that would repeat is not retried ``max_restarts`` times. The files stay the record on
disk for operators, and the path of a job with no store (one node); :func:`read` scans every node's
directory once where a launcher ends (simulated nodes share one run directory).
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
#: every rank of a restore rolled back past ``recovery.max_rollbacks`` (megatron_ft/trainer/guard.py)
EXIT_ROLLBACKS_EXHAUSTED = 3
#: the exit codes that end the whole job: never restarted (torchrun, fast restarts, a Kubernetes Job)
JOB_ENDING = (EXIT_CODE, EXIT_ROLLBACKS_EXHAUSTED)
#: a node's agent (and then its launcher) that stood down: judged lost while it did not run, its node
#: claimed by a standby meanwhile. The job goes on there; this node's processes end. Not a job's end.
EXIT_STOOD_DOWN = 4
FORMAT = "megatron-ft-fatal/1"


def record_path(run_dir: str, node: int) -> str:
    return os.path.join(run_dir, f"node{node}", "fatal.json")


def write(run_dir: str, node: int, message: str, code: int = EXIT_CODE) -> str:
    """Record that ``node`` ends the job with ``message`` and exit code ``code``; returns the file's path."""
    path = record_path(run_dir, node)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "node": node, "pid": os.getpid(), "message": message, "code": code}, f)
    os.replace(tmp, path)
    return path


def _load(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and rec.get("format") == FORMAT else None


def _first(run_dir: str) -> Optional[dict]:
    for path in sorted(glob.glob(os.path.join(run_dir, "node*", "fatal.json"))):
        if (rec := _load(path)) is not None:
            return rec
    return None


def read_node(run_dir: str, node: int) -> Optional[tuple[str, int]]:
    """(message, exit code) of ``node``'s own record, or None: one file, no scan."""
    rec = _load(record_path(run_dir, node))
    if rec is None:
        return None
    code = rec.get("code", EXIT_CODE)
    return str(rec.get("message", "")), code if isinstance(code, int) and 0 < code < 126 else EXIT_CODE


def store_value(node: int, message: str, code: int = EXIT_CODE) -> str:
    """The value of the store's ``fatal/<node>``: this format's record of ``node`` ending the job.

    >>> json.loads(store_value(3, "no agent", 2))["code"]
    2
    """
    return json.dumps({"format": FORMAT, "node": node, "message": message, "code": code})


def read(run_dir: str) -> Optional[tuple[int, str]]:
    """(node, message) of the first node that ended the job, or None."""
    rec = _first(run_dir)
    return None if rec is None else (int(rec.get("node", -1)), str(rec.get("message", "")))


def exit_code(run_dir: str) -> int:
    """The exit code the first node that ended the job recorded (:data:`EXIT_CODE` if none did)."""
    rec = _first(run_dir)
    code = rec.get("code", EXIT_CODE) if rec is not None else EXIT_CODE
    return code if isinstance(code, int) and 0 < code < 126 else EXIT_CODE


def end_job(message: str, code: int = EXIT_CODE) -> NoReturn:
    """In a trainer under ``megatron-ft launch``: record ``message`` for the launchers and exit
    with ``code`` (outside a launcher: just exit with it, saying why)."""
    run_dir, node = os.environ.get("MFT_RUN_DIR"), os.environ.get("MFT_NODE_RANK")
    if run_dir and node is not None:
        write(run_dir, int(node), message, code)
    log.error("megatron-ft: %s", message)
    print(f"[megatron-ft] fatal: {message}", file=sys.stderr, flush=True)
    sys.stderr.flush()
    os._exit(code)  # not SystemExit: no atexit handler or thread may hang the exit
