"""Fault injection for the demo, the chaos harness and the tests: a process SIGKILLs itself at a
named point of the runtime (:mod:`megatron_ft.faultpoints`), optionally damaging its snapshot first,
or hangs there.

A *fault* is ``<action>:<step>[:<rank>[,<rank>...]]`` (no ranks: any rank, and the agent; step ``*``:
any step, e.g. whichever step a restore chose). It fires at the first of the rank's steps at or after
``<step>`` that reaches its point: a snapshot skipped while the job's agreement is pending (an
agreement slower than an iteration: etcd, a loaded machine) never reaches ``after-commit``, and the
fault then fires at the next one that does. Actions:

* ``before-snapshot``, ``mid-copy``, ``after-commit``, ``restore``, ``mid-exchange`` - kill at that point;
* ``stop-<point>`` (e.g. ``stop-restore``) - at that point the process SIGSTOPs itself and stays stopped
  (alive, not running: what a debugger or a frozen container leaves) until something kills it;
* ``stall-<point>`` (e.g. ``stall-restore``) - at that point the calling thread sleeps forever (alive and
  runnable, but never returns: a deadlock or an endless wait as the hang rule sees it); the process's
  other threads go on;
* ``corrupt-after-commit`` - at ``after-commit``, first flip a byte of the committed data (a
  corrupted snapshot that restore must reject);
* ``poison-after-commit`` - at ``after-commit``, first write NaN into the snapshot's first
  floating-point tensor and recompute the checksums of the chunks it touched: the snapshot verifies,
  its values are garbage (what a replica written from a model that already held NaN looks like);
  restore's guard must refuse it and roll back to the rank's older version;
* ``poison-expert-after-commit`` - the same NaN, written into the snapshot's first floating-point
  *expert* tensor (:func:`expert_tensors`: a MoE rank's expert parameter bucket slice, else its expert
  optimizer state), checksums recomputed: only the guard can tell, on the rank that owns that expert
  shard; the event line names the tensor. A snapshot without expert tensors is an error naming it;
* ``scale-optimizer-after-commit`` - the same with Adam's first moments multiplied by
  :data:`OPTIMIZER_SCALE`: finite values that verify, and a loss spike after the next optimizer step;
  the guard's loss check after the restore must roll the job back to the version before;
* ``truncate-after-commit``, ``truncate-header-after-commit``, ``truncate-empty-after-commit`` - at
  ``after-commit``, first cut the committed slot's file inside its data (to half its size), inside its
  4 KiB header (to 100 bytes) or to zero bytes (no reader may map past its end; restore must reject
  that version and take the rank's older clean one).

An action ending in ``+agent`` (e.g. ``truncate-empty-after-commit+agent``) first SIGKILLs the rank's
node agent (its pid from ``run_dir/node<N>/agent.pid``) and waits until it is gone, so the damage is
found by the agent its launcher starts next, from what the dead one left in shared memory.

A hang (``stop-``, ``stall-``) writes its event line before it begins, and never returns.

Each rank fires at most once per run when ``run_dir`` is given (a marker file
``run_dir/faults/node<N>/rank<R>.fired``, :mod:`megatron_ft.rank_files`, remembers it; the agent's is
``node<N>/agent.fired``; torchrun's restart counter cannot, since only the failed node's counter
moves), so the restarted job runs clean; an event line is written to
``run_dir/events/node<N>/rank<R>.jsonl`` (the agent's: ``agent.jsonl``) just before the kill.

Wrap a program to give it the injector::

    python -m megatron_ft.testing.faults --fault mid-copy:5:1 [--run-dir DIR] -- SCRIPT [ARGS...]
    python -m megatron_ft.testing.faults --fault mid-exchange:3 -- -m megatron_ft.agent [ARGS...]

(``--run-dir`` defaults to ``$MFT_RUN_DIR``, which ``megatron-ft launch`` gives its trainers.)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import runpy
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

from .. import rank_files
from ..faultpoints import POINTS, install

#: truncate action -> the length it cuts a committed slot's file of ``size`` bytes to
TRUNCATE_TO = {
    "truncate-after-commit": lambda size: size // 2,  # inside the data
    "truncate-header-after-commit": lambda size: 100,  # inside the 4 KiB container header
    "truncate-empty-after-commit": lambda size: 0,
}
#: action -> the runtime point it fires at
#: actions that change the committed snapshot's values, its checksums recomputed (it still verifies)
REWRITES = ("poison-after-commit", "scale-optimizer-after-commit", "poison-expert-after-commit")
#: hang actions: the prefix -> what the process does at the point instead of dying
HANGS = {"stop-": "SIGSTOP itself", "stall-": "sleep forever on the calling thread"}
ACTIONS = {**{p: p for p in POINTS}, "corrupt-after-commit": "after-commit", **{a: "after-commit" for a in REWRITES},
           **{a: "after-commit" for a in TRUNCATE_TO}, **{h + p: p for h in HANGS for p in POINTS}}
#: the step of a fault that matches any step
ANY_STEP = "*"
#: an action with this suffix kills the node's agent first
WITH_AGENT = "+agent"


@dataclass(frozen=True)
class Fault:
    action: str
    step: Optional[int]  # None: any step (``*``)
    ranks: Optional[frozenset] = None  # None: any rank (and the agent)
    with_agent: bool = False  # SIGKILL the node's agent first (``+agent``)

    @property
    def point(self) -> str:
        return ACTIONS[self.action]

    @property
    def hang(self) -> Optional[str]:
        """``stop-`` or ``stall-`` for a hang action, else None (the process dies)."""
        return next((h for h in HANGS if self.action.startswith(h)), None)


def parse(spec: str) -> Fault:
    """``<action>:<step>[:<rank>[,<rank>...]]`` (step ``*``: any) -> :class:`Fault`; a clear error otherwise."""
    parts = spec.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        step = None if parts[1] == ANY_STEP else int(parts[1])
        ranks = frozenset(int(r) for r in parts[2].split(",")) if len(parts) == 3 else None
    except ValueError:
        raise ValueError(f"fault {spec!r} is invalid: expected <action>:<step>[:<rank>[,<rank>...]] (step an "
                         f"integer or {ANY_STEP!r})") from None
    action = parts[0].removesuffix(WITH_AGENT)
    if action not in ACTIONS:
        raise ValueError(f"fault action {parts[0]!r} is invalid: allowed {sorted(ACTIONS)}, each optionally "
                         f"followed by {WITH_AGENT!r}")
    if action.startswith(tuple(HANGS)) and parts[0].endswith(WITH_AGENT):
        raise ValueError(f"fault action {parts[0]!r} is invalid: a hang ({', '.join(h + '*' for h in HANGS)}) "
                         f"takes no {WITH_AGENT!r}")
    return Fault(action, step, ranks, parts[0].endswith(WITH_AGENT))


class KillAt:
    """An :class:`megatron_ft.faultpoints.Injector` that SIGKILLs the process at its fault (or, for a
    hang action, stops it or stalls the calling thread there for good)."""

    def __init__(self, fault: Fault, run_dir: Optional[str] = None, node: Optional[int] = None):
        """``node``: the node this process's files go under (None: :func:`.rank_files.process_node`)."""
        self.fault, self.run_dir, self.node = fault, run_dir, node

    def reached(self, point: str, step: int, rank: int, **context: Any) -> None:
        f = self.fault
        if point != f.point or f.step is not None and step < f.step or (f.ranks is not None and rank not in f.ranks):
            return
        if self.run_dir and not self._first_time(rank):
            return
        agent = self._kill_agent() if f.with_agent else None
        changed: Optional[list[str]] = None  # the tensors a rewrite changed
        if f.action == "corrupt-after-commit":
            area = context["area"]
            area[len(area) // 2] ^= 0xFF
        elif f.action == "poison-after-commit":
            changed = poison(context["path"])
        elif f.action == "poison-expert-after-commit":
            changed = poison_expert(context["path"])
        elif f.action == "scale-optimizer-after-commit":
            changed = scale_optimizer(context["path"])
        elif f.action in TRUNCATE_TO:
            os.truncate(context["path"], TRUNCATE_TO[f.action](context["size"]))
        if self.run_dir:
            path = self._path("events", rank, ".jsonl", "agent.jsonl")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "a") as out:
                out.write(json.dumps({"event": "fault", "point": f.action, "step": step, "rank": rank,
                                      "pid": os.getpid(), "agent_killed": agent, "time": time.time(),
                                      **({"tensors": changed} if changed is not None else {})}) + "\n")
        if f.hang == "stop-":
            os.kill(os.getpid(), signal.SIGSTOP)  # every thread stops here; only a SIGCONT or SIGKILL ends it
            return
        if f.hang == "stall-":
            while True:
                time.sleep(3600)
        os.kill(os.getpid(), signal.SIGKILL)

    def _kill_agent(self, wait_s: float = 10.0) -> int:
        """SIGKILL this trainer's node agent and wait (at most ``wait_s``) until it is gone; its pid."""
        import psutil

        if not self.run_dir or "MFT_NODE_RANK" not in os.environ:
            raise RuntimeError(f"fault {self.fault.action}{WITH_AGENT} needs a run directory and MFT_NODE_RANK "
                               f"(a trainer under megatron-ft launch)")
        with open(os.path.join(self.run_dir, f"node{os.environ['MFT_NODE_RANK']}", "agent.pid")) as f:
            pid = int(f.read())
        os.kill(pid, signal.SIGKILL)
        deadline = time.time() + wait_s
        while time.time() < deadline:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:  # not reaped yet, but runs no code
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.01)
        return pid

    def _path(self, kind: str, rank: int, suffix: str, agents: str) -> str:
        """``run_dir/<kind>/node<N>/rank<R><suffix>`` (:mod:`megatron_ft.rank_files`), or the node's
        ``agents`` file for the agent (rank -1); N is this process's node (``MFT_NODE_RANK``)."""
        base = os.path.join(self.run_dir, kind)  # type: ignore[arg-type]
        if rank < 0:
            return rank_files.node_path(base, self.node if self.node is not None else rank_files.process_node(),
                                        agents)
        return rank_files.rank_path(base, rank, suffix,
                                    self.node if self.node is not None else rank_files.process_node(rank))

    def _first_time(self, rank: int) -> bool:
        marker = self._path("faults", rank, ".fired", "agent.fired")
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False  # fired in an earlier attempt


def poison(path: str, value: float = float("nan")) -> list[str]:
    """Fill the first floating-point tensor of the committed snapshot in ``path`` with ``value`` and
    store the new checksums of the chunks it spans, so that the snapshot still verifies. Returns the
    tensor's name (in a list)."""
    return _rewrite(path, lambda floats: floats[:1], lambda t: t.fill_(value))


#: a MoE rank's expert parameter bucket in the project's adapter (megatron_ft.megatron.state: ``e`` buffers)
_EXPERT_BUCKET = re.compile(r"^model\.c\d+\.e\d+\.k\d+\.")
#: the expert part of a chained optimizer there: the second inner optimizer (``o1``; dense is ``o0``)
_EXPERT_OPTIMIZER = re.compile(r"^optim\.o1\.")


def expert_tensors(floats: list[str]) -> list[str]:
    """Among a snapshot's floating-point tensor names (layout order), those of expert shards: expert
    parameter bucket slices first, then the expert optimizer's state (``megatron_ft.megatron.state``),
    then, in a snapshot of upstream Megatron-LM's state dict, its ``.experts.`` tensors (not the
    router's ``expert_bias``, which every rank holds whole). ``optim.o1`` counts only beside an expert
    bucket (a chained optimizer's second part holds experts only in a MoE job)."""
    buckets = [n for n in floats if _EXPERT_BUCKET.match(n)]
    if buckets:
        return buckets + [n for n in floats if _EXPERT_OPTIMIZER.match(n)]
    return [n for n in floats if ".experts." in n]


def poison_expert(path: str, value: float = float("nan")) -> list[str]:
    """:func:`poison` on the first expert tensor (:func:`expert_tensors`) of the committed snapshot in
    ``path``, checksums recomputed. Returns its name (in a list); a snapshot without expert tensors is a
    ``ValueError`` naming the path."""
    def pick(floats: list[str]) -> list[str]:
        experts = expert_tensors(floats)
        if not experts:
            raise ValueError(f"{path}: no expert tensor to poison (not a mixture-of-experts rank's snapshot; "
                             f"floating-point tensors: {floats[:5]}...)")
        return experts[:1]

    return _rewrite(path, pick, lambda t: t.fill_(value))


#: the factor ``scale-optimizer-after-commit`` multiplies Adam's first moments by
OPTIMIZER_SCALE = 1e4


def scale_optimizer(path: str, factor: float = OPTIMIZER_SCALE) -> list[str]:
    """Multiply every Adam first moment (a tensor named ``*exp_avg``) of the committed snapshot in
    ``path`` by ``factor``, checksums recomputed: finite values that verify, and an update ``factor``
    times too large at the first optimizer step after a restore. Returns the tensors' names."""
    return _rewrite(path, lambda floats: [n for n in floats if n.endswith("exp_avg")], lambda t: t.mul_(factor))


def _rewrite(path: str, pick, change) -> list[str]:
    """Apply ``change`` (in place) to the tensors ``pick`` names among the committed snapshot's
    floating-point ones (in layout order) in ``path``, then store the checksums of the chunks they span."""
    import mmap

    import numpy as np
    import torch

    from ..capture import checksum, snapfile
    from ..capture.layout import dtype_from_name

    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        hdr = snapfile.read_header(mm)
        layout, version = snapfile.read_layout(mm, hdr), snapfile.read_version(mm, hdr)
        entries = layout.by_name()
        floats = [e.spec.name for e in layout.entries if e.spec.numel and dtype_from_name(e.spec.dtype).is_floating_point]
        names = pick(floats)
        if not names:
            raise ValueError(f"{path}: no tensor to change (floating-point tensors: {floats[:5]}...)")
        base = hdr.geometry.data_off
        chunks: set[int] = set()
        for name in names:
            e = entries[name]
            change(torch.frombuffer(mm, dtype=dtype_from_name(e.spec.dtype), count=e.spec.numel, offset=base + e.offset))
            chunks.update(range(e.offset // layout.chunk_size, (e.end - 1) // layout.chunk_size + 1))
        data = np.frombuffer(mm, np.uint8, count=layout.data_nbytes, offset=base)
        for i in sorted(chunks):
            lo, hi = layout.chunk_bounds(i)
            version["chunks"][i] = f"{checksum.checksum_numpy(data[lo:hi], version['checksum']):016x}"
        del data
        snapfile.write_version(mm, hdr.step, {k: v for k, v in version.items() if k not in ("format", "version", "step")})
    return names


def wrap(script: list[str], fault: str, run_dir: Optional[str] = None) -> list[str]:
    """The argument list that runs ``script`` (a path and its arguments) with ``fault`` injected,
    for ``python`` or for torchrun (which takes ``-m MODULE``)."""
    out = ["-m", __name__, "--fault", fault]
    if run_dir:
        out += ["--run-dir", run_dir]
    return [*out, "--", *script]


def _agent_node(program: list[str]) -> Optional[int]:
    """The ``--node N`` of a wrapped ``-m megatron_ft.agent`` (its files go under node N), else None."""
    if program[:2] != ["-m", "megatron_ft.agent"] or "--node" not in program[:-1]:
        return None
    value = program[program.index("--node") + 1]
    if not value.isdigit():
        raise SystemExit(f"--node {value!r} is invalid: a non-negative integer")
    return int(value)


def main(argv: Optional[list[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("usage: python -m megatron_ft.testing.faults --fault F [--run-dir D] -- "
                         "(SCRIPT | -m MODULE) [ARGS...]")
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m megatron_ft.testing.faults",
                                description="run a script or module with a fault injected")
    p.add_argument("--fault", required=True, help="<action>:<step>[:<rank>[,<rank>...]]")
    p.add_argument("--run-dir", default=os.environ.get("MFT_RUN_DIR"),
                   help="fire once per rank across restarts (marker files); default $MFT_RUN_DIR")
    args = p.parse_args(argv[:cut])
    program = argv[cut + 1:]
    if not program or program[0] == "-m" and len(program) < 2:
        p.error("a SCRIPT or -m MODULE after -- is required")
    install(KillAt(parse(args.fault), args.run_dir, _agent_node(program)))
    if program[0] == "-m":
        sys.argv[:] = [program[1], *program[2:]]
        runpy.run_module(program[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(program[0])
        sys.argv[:] = [script, *program[1:]]
        sys.path.insert(0, os.path.dirname(script))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
