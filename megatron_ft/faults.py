"""Fault injection for tests and the demo: a trainer SIGKILLs itself at a named point.

Set ``MFT_FAULT_INJECT=<point>:<step>:<rank>[,<rank>...]``; each rank fires at most once per run
(a marker file in ``$MFT_RUN_DIR/faults`` remembers it; torchrun's restart counter cannot, since
only the failed node's counter moves), so the restarted job runs clean. Points:

* ``before-snapshot`` - iteration ``step`` finished, its snapshot not yet started;
* ``mid-copy``        - the snapshot of ``step`` has copied its first piece of tensor bytes, not the rest;
* ``after-commit``    - the agent has marked the snapshot of ``step`` clean;
* ``corrupt-after-commit`` - as ``after-commit``, but first flip a byte of the committed data
  (a corrupted snapshot that restore must reject);
* ``truncate-after-commit`` - as ``after-commit``, but first cut the committed slot's file to half
  its size (no reader may map past its end; restore must reject it).

The kill is a real ``SIGKILL`` of the process; an event line is written just before it.
"""
from __future__ import annotations

import json
import os
import signal
import time
from typing import Callable, Optional

POINTS = ("before-snapshot", "mid-copy", "after-commit", "corrupt-after-commit", "truncate-after-commit")


def _parse() -> Optional[tuple[str, int, set[int]]]:
    spec = os.environ.get("MFT_FAULT_INJECT")
    if not spec:
        return None
    try:
        point, step, ranks = spec.split(":")
        parsed = (point, int(step), {int(r) for r in ranks.split(",")})
    except ValueError:
        raise ValueError(f"MFT_FAULT_INJECT={spec!r} is invalid: expected <point>:<step>:<rank>[,<rank>...]") from None
    if point not in POINTS:
        raise ValueError(f"MFT_FAULT_INJECT point {point!r} is invalid: allowed {POINTS}")
    return parsed


_SPEC = _parse()


def maybe_fail(point: str, step: int, rank: int, before: Optional[Callable[[], None]] = None) -> None:
    if _SPEC is None or _SPEC[0] != point or _SPEC[1] != step or rank not in _SPEC[2]:
        return
    run_dir = os.environ.get("MFT_RUN_DIR")
    if not run_dir:
        raise RuntimeError("MFT_FAULT_INJECT needs MFT_RUN_DIR (to fire only once)")
    marker = os.path.join(run_dir, "faults", f"rank{rank}.fired")
    os.makedirs(os.path.dirname(marker), exist_ok=True)
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return  # fired in an earlier attempt
    if before is not None:
        before()
    os.makedirs(os.path.join(run_dir, "events"), exist_ok=True)
    with open(os.path.join(run_dir, "events", f"rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps({"event": "fault", "point": point, "step": step, "rank": rank,
                            "pid": os.getpid(), "time": time.time()}) + "\n")
    os.kill(os.getpid(), signal.SIGKILL)


def maybe_fail_agent(point: str, step: int) -> None:
    """The node's agent SIGKILLs itself at ``point`` of ``step`` when ``MFT_AGENT_FAULT`` is
    ``<point>:<step>`` (points: ``mid-exchange`` - after the first contribution of the version
    left this node, before the rest: the node is lost in the middle of encoding/transfer)."""
    spec = os.environ.get("MFT_AGENT_FAULT", "")
    if spec != f"{point}:{step}":
        return
    os.kill(os.getpid(), signal.SIGKILL)
