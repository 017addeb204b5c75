"""The hang rule: which rank is hung, from where every rank is (:mod:`.progress`). Pure: no I/O.

In synchronous training every rank stops within an iteration of a hung one, so "no progress" alone
cannot name the culprit: the others are *waiting* - in a collective, or for their own agent - and the
culprit is not. Many ranks quiet in their own work at once (a long write of every rank) is no verdict:
the hung ranks must be few (at most one node's, and no more than the waiting ones) - unless every one of
them is past a deadline of its phase's own (its start-up, a rendezvous, its restore, Megatron's own
save: :func:`overdue`): ranks that all stay that long in such a phase are stuck however many they are (a
round that never forms: nothing else would notice it). Each node's agent classifies its ranks
(:func:`judge`) against a *bound* derived from the job's own iteration times (:func:`bound`) and reports
the node's stall (:class:`NodeStall`, only when it changes: nothing while the job trains); the job's
verdict (:func:`decide`) names the hung ranks once every other rank of the job waits:

* ``hung``: quiet in its own work (or its restore, Megatron's own disk save, its start-up, a rendezvous)
  past that phase's allowance, or seen stopped (SIGSTOP, a tracer) continuously for ``floor_s`` while quiet
  as long;
* ``waiting``: in a collective, a rendezvous or waiting for its agent for at least half ``floor_s``
  (every routine wait is far shorter; a verdict needs the culprit past its own allowance besides);
* anything else (progressing, starting, ending, gone) blocks a verdict.

With ``collective_s`` set, every rank waiting that long with nobody to blame (a collective that
deadlocked) is a verdict on all of them. Such a verdict - and one on ranks all past their deadlines -
names no rank (O(1) in the store however large the job): each agent ends those of its own ranks that
still qualify, judged again on its own records.

>>> lim = Limits(k=10.0, floor_s=5.0, ceiling_s=120.0, warmup_iterations=3, first_s=60.0, restore_s=300.0,
...              save_s=3600.0, collective_s=0.0)
>>> bound(lim, p99_s=0.2, steps=10), bound(lim, p99_s=2.0, steps=10), bound(lim, p99_s=0.2, steps=1)
(5.0, 20.0, 60.0)
>>> from .progress import Progress, WORK, COLLECTIVE
>>> stuck = Progress(seq=8, steps=10, phase=WORK, pid=41, since=100.0, started=0, iter_s=0.2, work_s=0.1)
>>> judge(stuck, now=106.0, limits=lim, p99_s=0.2, stopped_s=0.0)
'hung'
>>> waits = Progress(seq=9, steps=10, phase=COLLECTIVE, pid=42, since=100.1, started=0, iter_s=0.2, work_s=0.1)
>>> judge(waits, now=106.0, limits=lim, p99_s=0.2, stopped_s=0.0)
'waiting'
>>> a = NodeStall(node=0, ranks=1, hung=(Culprit(0, 41, 8, "work", 6.0),), waiting=())
>>> b = NodeStall(node=1, ranks=1, hung=(), waiting=(1,))
>>> decide({0: a}, nodes=2, ranks_per_node=1, collective_s=0) is None   # node 1 has not said it waits
True
>>> v = decide({0: a, 1: b}, nodes=2, ranks_per_node=1, collective_s=0)
>>> [c.rank for c in v.culprits], v.collective
([0], False)

A round that never formed: every rank still in its rendezvous past ``start_s`` is hung, all of them.

>>> never = NodeStall(node=0, ranks=1, hung=(Culprit(0, 41, 3, "rendezvous", 901.0),), waiting=())
>>> decide({0: never, 1: NodeStall(1, 1, (Culprit(1, 42, 3, "rendezvous", 901.0),), ())}, nodes=2,
...        ranks_per_node=1, collective_s=0)
HangVerdict(culprits=(), collective=False, overdue=True)
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from .progress import AGENT, COLLECTIVE, RENDEZVOUS, RESTORE, SAVE, START, WAITING, WORK, Progress

VERSION = 1
#: the store keys: each node's stall under ``STALL_KEY<node>``, the job's verdict at ``HANG_KEY``
STALL_KEY = "stall/"
HANG_KEY = "hang"


@dataclass(frozen=True)
class Limits:
    """The ``hang`` section's numbers (:class:`megatron_ft.config.HangConfig`)."""

    k: float
    floor_s: float
    ceiling_s: float
    warmup_iterations: int
    first_s: float
    restore_s: float
    save_s: float
    collective_s: float
    start_s: float = 900.0
    max_culprits: int = 0  # 0: one node's ranks

    @classmethod
    def of(cls, hang) -> "Limits":
        return cls(hang.k, hang.floor_s, hang.ceiling_s, hang.warmup_iterations, hang.first_s, hang.restore_s,
                   hang.save_s, hang.collective_s, hang.start_s, hang.max_culprits)


def p99(times: Sequence[float]) -> Optional[float]:
    """The 99th percentile (nearest rank) of ``times``; None for none.

    >>> p99([0.1] * 99 + [5.0]), p99([0.1] * 98 + [5.0, 5.0]), p99([])
    (0.1, 5.0, None)
    """
    if not times:
        return None
    s = sorted(times)
    return s[max(0, math.ceil(0.99 * len(s)) - 1)]


def bound(limits: Limits, p99_s: Optional[float], steps: int) -> float:
    """How long a rank may stay quiet in its own work: ``k`` x the p99 of recent iterations within
    [``floor_s``, ``ceiling_s``]; ``first_s`` before ``warmup_iterations`` iterations of this trainer."""
    if steps < limits.warmup_iterations or p99_s is None:
        return max(limits.first_s, limits.floor_s)
    return min(limits.ceiling_s, max(limits.floor_s, limits.k * p99_s))


def allowance(limits: Limits, phase: int, p99_s: Optional[float], steps: int) -> Optional[float]:
    """How long ``phase`` may stay quiet before its rank is hung; None: a phase never judged so."""
    if phase == WORK:
        return bound(limits, p99_s, steps)
    if phase == RESTORE:
        return limits.restore_s
    if phase == SAVE:
        return limits.save_s
    if phase in (START, RENDEZVOUS):  # a rendezvous is part of the start-up, and has its deadline
        return limits.start_s
    return None


#: the phases whose allowance is a fixed deadline of their own, not the job's iteration times
FIXED_ALLOWANCE = frozenset({"start", "rendezvous", "restore", "save"})


def overdue(c: "Culprit") -> bool:
    """Whether ``c`` was judged hung past a fixed deadline (:data:`FIXED_ALLOWANCE`): such ranks are a
    verdict however many they are (:func:`decide`).

    >>> overdue(Culprit(0, 7, 2, "restore", 301.0)), overdue(Culprit(0, 7, 2, "work", 6.0))
    (True, False)
    >>> overdue(Culprit(0, 7, 2, "start (stopped)", 6.0, stopped=True))   # stopped, not past its deadline
    False
    """
    return not c.stopped and c.phase in FIXED_ALLOWANCE


def judge(p: Progress, now: float, limits: Limits, p99_s: Optional[float], stopped_s: float) -> str:
    """``hung``, ``waiting`` or ``other`` for one rank's record ``p`` at ``now`` (its clock);
    ``stopped_s``: how long its process has been seen stopped without a break (0: running)."""
    quiet = now - p.since
    if stopped_s >= limits.floor_s and quiet >= limits.floor_s:
        return "hung"
    limit = allowance(limits, p.phase, p99_s, p.steps)
    if limit is not None and quiet > limit:
        return "hung"
    if p.phase in WAITING and quiet >= limits.floor_s / 2:
        return "waiting"
    return "other"


def _versioned(text: str, what: str) -> dict:
    """The JSON record ``text``, refused (ValueError naming ``what``) unless it is of :data:`VERSION`."""
    d = json.loads(text)
    if not isinstance(d, dict) or d.get("v") != VERSION:
        raise ValueError(f"{what} version {d.get('v') if isinstance(d, dict) else None!r}, not {VERSION}")
    return d


@dataclass(frozen=True)
class Culprit:
    """A rank judged hung: which process, at which record (a verdict acts only while both still hold)."""

    rank: int
    pid: int
    seq: int
    phase: str
    quiet_s: float
    stopped: bool = False  # seen stopped (SIGSTOP, a tracer), not only quiet

    def encoded(self) -> list:
        return [self.rank, self.pid, self.seq, self.phase, round(self.quiet_s, 3), self.stopped]

    @classmethod
    def decoded(cls, item: list) -> "Culprit":
        r, p, s, ph, q, *rest = item
        return cls(int(r), int(p), int(s), str(ph), float(q), bool(rest[0]) if rest else False)


@dataclass(frozen=True)
class NodeStall:
    """A node's report: its hung ranks and its waiting ranks (``ranks``: how many it has). ``long``:
    every waiting rank has waited ``collective_s`` (see the module)."""

    node: int
    ranks: int
    hung: tuple[Culprit, ...]
    waiting: tuple[int, ...]
    long: bool = False

    @property
    def clear(self) -> bool:
        return not self.hung and not self.waiting

    def same(self, other: Optional["NodeStall"]) -> bool:
        """Whether ``other`` says the same (the quiet times aside): a report is sent only when not."""
        return (other is not None and self.waiting == other.waiting and self.long == other.long
                and [(c.rank, c.pid, c.seq) for c in self.hung] == [(c.rank, c.pid, c.seq) for c in other.hung])

    def encode(self) -> str:
        return json.dumps({"v": VERSION, "node": self.node, "ranks": self.ranks, "waiting": list(self.waiting),
                           "long": self.long,
                           "hung": [c.encoded() for c in self.hung]})

    @classmethod
    def decode(cls, text: str) -> "NodeStall":
        d = _versioned(text, "stall report")
        return cls(int(d["node"]), int(d["ranks"]),
                   tuple(Culprit.decoded(c) for c in d["hung"]),
                   tuple(int(r) for r in d["waiting"]), bool(d.get("long", False)))


@dataclass(frozen=True)
class HangVerdict:
    """The job's verdict: these ranks are hung. Or, naming none (``culprits`` empty), every rank is:
    ``collective`` - every rank waited ``collective_s`` in collectives with nobody to blame; ``overdue`` -
    every hung rank is past a deadline of its phase's own (:func:`overdue`). Each agent then ends its own
    ranks that still qualify."""

    culprits: tuple[Culprit, ...]
    collective: bool = False
    overdue: bool = False

    @property
    def every_rank(self) -> bool:
        return self.collective or self.overdue

    def encode(self) -> str:
        return json.dumps({"v": VERSION, "collective": self.collective, "overdue": self.overdue,
                           "culprits": [c.encoded() for c in self.culprits]})

    @classmethod
    def decode(cls, text: str) -> "HangVerdict":
        d = _versioned(text, "hang verdict")
        return cls(tuple(Culprit.decoded(c) for c in d["culprits"]), bool(d["collective"]),
                   bool(d.get("overdue", False)))


def blames(hung: Sequence[Culprit], waiting: int, world: int, max_culprits: int) -> bool:
    """Whether ``hung`` ranks, with ``waiting`` others waiting, make a verdict: the hung ones a few (at
    most ``max_culprits``, and no more than the waiting) - many ranks quiet in their own work at once is
    the job's own work (a long write everywhere; on NCCL, ranks blocked in a device sync behind one
    stuck peer look so too), not a hang to end them for. A job of one rank: only a stopped process.
    (Ranks all :func:`overdue` are a verdict however many: :func:`decide`.)"""
    if not hung:
        return False
    if world == 1:
        return all(c.stopped for c in hung)
    return len(hung) <= min(waiting, max_culprits)


def decide(reports: Mapping[int, NodeStall], nodes: int, ranks_per_node: int,
           collective_s: float, max_culprits: int = 0) -> Optional[HangVerdict]:
    """The job's verdict from every node's newest report, or None. A verdict needs every rank of the job
    accounted for - hung, or waiting - and the hung ones few (:func:`blames`; ``max_culprits`` 0: one
    node's ranks), or all :func:`overdue`. A collective or an overdue verdict names no rank: each agent
    ends those of its ranks that still qualify."""
    if len(reports) < nodes:
        return None
    hung = [c for n in sorted(reports) for c in reports[n].hung]
    waiting = {r for rep in reports.values() for r in rep.waiting}
    if len({c.rank for c in hung} | waiting) < nodes * ranks_per_node:
        return None
    if hung and all(overdue(c) for c in hung):
        return HangVerdict((), overdue=True)
    if blames(hung, len(waiting), nodes * ranks_per_node, max_culprits or ranks_per_node):
        return HangVerdict(tuple(hung))
    if not hung and collective_s > 0 and all(rep.long for rep in reports.values()):
        return HangVerdict((), collective=True)
    return None


class StallAggregator:
    """The root's running view: :meth:`update` with one node's report returns the verdict now, as
    :func:`decide` would from every newest report - in O(L) per report (running counts of the ranks
    accounted for, the waiting ones and the nodes whose ranks all waited long; the hung ranks listed),
    never a pass over the N reports while a stall's N reports arrive."""

    def __init__(self, nodes: int, ranks_per_node: int, collective_s: float, max_culprits: int = 0):
        self.nodes, self.ranks_per_node, self.collective_s = nodes, ranks_per_node, collective_s
        self.max_culprits = max_culprits or ranks_per_node
        self.reports: dict[int, NodeStall] = {}
        self._accounted = self._waiting = self._long = self._within = 0  # _within: hung, not overdue
        self._hung: dict[int, tuple[Culprit, ...]] = {}

    def _count(self, report: NodeStall, sign: int) -> None:
        self._accounted += sign * len({c.rank for c in report.hung} | set(report.waiting))
        self._waiting += sign * len(report.waiting)
        self._long += sign * int(report.long)
        self._within += sign * sum(1 for c in report.hung if not overdue(c))

    def update(self, report: NodeStall) -> Optional[HangVerdict]:
        old = self.reports.pop(report.node, None)
        if old is not None:
            self._count(old, -1)
            self._hung.pop(report.node, None)
        if not report.clear:
            self.reports[report.node] = report
            self._count(report, +1)
            if report.hung:
                self._hung[report.node] = report.hung
        if len(self.reports) < self.nodes or self._accounted < self.nodes * self.ranks_per_node:
            return None
        if self._hung and not self._within:
            return HangVerdict((), overdue=True)
        if self._hung and len(self._hung) <= self.max_culprits:  # else more hung ranks than one verdict takes
            hung = [c for n in sorted(self._hung) for c in self._hung[n]]
            if blames(hung, self._waiting, self.nodes * self.ranks_per_node, self.max_culprits):
                return HangVerdict(tuple(hung))
        if not self._hung and self.collective_s > 0 and self._long == self.nodes:
            return HangVerdict((), collective=True)
        return None


__all__ = ["AGENT", "COLLECTIVE", "Culprit", "HANG_KEY", "HangVerdict", "Limits", "NodeStall", "STALL_KEY",
           "StallAggregator", "allowance", "bound", "decide", "judge", "overdue", "p99"]
