"""Which step the whole job holds, decided by the agents off the training path (pure: no I/O, no
locks, no clocks).

A trainer waits before its next optimizer step only for its own copy to be committed (the bytes
must not change while they are copied). Which step *every* rank holds is decided here, from what
each node's agent knows of its own ranks:

* each agent reports its node (:class:`NodeReport`): ``held``, the steps every local rank holds
  clean, and ``seen``, the newest step every local rank has *finished with* (committed, failed,
  skipped or told the agent it will not snapshot);
* one aggregator (the root agent's, :class:`Aggregator`) combines the N reports incrementally and
  publishes one :class:`Verdict`; every agent applies it to its own ranks.

Each step ends in one of two ways:

* **agreed**: every node holds it clean (then it is the protected version: ``begin`` never hands
  its slot out until a newer step is agreed);
* **abandoned**: some node finished with it without holding it (one of its ranks failed or skipped
  it, or was restored past it) - it will never be held by every rank.

A rank holds at most one *pending* version (committed, newer than the agreed step, neither agreed
nor abandoned; abandoned on its own node already when a local rank finished with it without holding
it, :func:`resolved`). With two slots per rank (the agreed one and one other) a snapshot due while the
rank's pending version is unresolved is **skipped** (the agent refuses ``begin`` with
:class:`PendingAgreement`): overwriting it could postpone every agreement forever when the
agreement takes longer than an iteration, and overwriting the agreed one would leave the job
without a consistent version. Since a skipped rank has *seen* the step, the pending one of a rank
that skipped cannot wait on it: every step is resolved once every node's report is newer than it.

Costs (R ranks, N nodes): per agreed step each agent sends one report and receives one verdict:
2N messages job-wide, constant per node, two rounds (report, verdict); the aggregator does
O(log N + S) work per report (S: steps in flight, a handful).

Worked example: two nodes, node 1 slower.

>>> agg = Aggregator(nodes=2)
>>> agg.update(0, NodeReport(held=(9, 10), seen=10))
Verdict(agreed=-1, abandoned=())
>>> agg.update(1, NodeReport(held=(9,), seen=9))      # node 1 is still writing step 10
Verdict(agreed=9, abandoned=())
>>> agg.update(1, NodeReport(held=(9, 10), seen=10))
Verdict(agreed=10, abandoned=())
>>> agg.update(0, NodeReport(held=(10, 11), seen=12))  # node 0 took 11, then skipped 12
Verdict(agreed=10, abandoned=())
>>> agg.update(1, NodeReport(held=(10, 12), seen=12))  # node 1 skipped 11, took 12: both abandoned
Verdict(agreed=10, abandoned=(11, 12))
>>> agg.verdict().resolves(11), agg.verdict().resolves(13)
(True, False)
"""
from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from typing import Iterable, Optional

from .certification import JobCertifier
from .versions import BusyError

__all__ = ["FORMAT", "NodeReport", "Verdict", "Aggregator", "PendingAgreement", "decide", "node_report", "resolved"]

#: version of the report and verdict records in the store (explicit JSON, never pickle)
FORMAT = 1
#: the store keys: one report per node, one verdict per job
REPORT_KEY = "agree/"
VERDICT_KEY = "agreed"


class PendingAgreement(BusyError):
    """``begin`` refused: the rank's previous snapshot is still waiting for the job's agreement (the
    snapshot of this step is skipped; training goes on)."""

    pending = True


@dataclass(frozen=True)
class NodeReport:
    """What one node's agent knows of its ranks: ``held``, the steps every local rank holds clean
    (ascending); ``seen``, the newest step every local rank has finished with (-1: none yet; never
    older than a step it holds: an agent restarted over its slots knows them, not what its ranks saw).

    >>> NodeReport((3, 5), seen=-1)
    NodeReport(held=(3, 5), seen=5)
    """

    held: tuple[int, ...] = ()
    seen: int = -1
    #: ``recovery.prefer: certified``: the newest iteration every local rank judged (its loss), and the
    #: iterations some local rank found anomalous that the job's verdict has not judged yet
    judged: int = -1
    anomalies: tuple[int, ...] = ()

    def __post_init__(self) -> None:  # a node has finished with every step it holds
        if self.held and self.seen < self.held[-1]:
            object.__setattr__(self, "seen", self.held[-1])

    def __repr__(self) -> str:
        more = f", judged={self.judged}, anomalies={self.anomalies}" if self.judged >= 0 or self.anomalies else ""
        return f"NodeReport(held={self.held}, seen={self.seen}{more})"

    def encode(self) -> str:
        rec = {"v": FORMAT, "held": list(self.held), "seen": self.seen}
        if self.judged >= 0 or self.anomalies:
            rec.update(judged=self.judged, anomalies=list(self.anomalies))
        return json.dumps(rec, separators=(",", ":"))

    @classmethod
    def decode(cls, text: str) -> "NodeReport":
        """A report from the store; ValueError naming what is wrong with it."""
        rec = json.loads(text)
        if not isinstance(rec, dict) or rec.get("v") != FORMAT:
            raise ValueError(f"agreement report of format {rec.get('v') if isinstance(rec, dict) else rec!r}, "
                             f"this version reads {FORMAT}")
        held, seen = rec.get("held"), rec.get("seen")
        judged, anomalies = rec.get("judged", -1), rec.get("anomalies", [])
        if not isinstance(held, list) or not all(isinstance(s, int) and s >= 0 for s in held) or \
                not isinstance(seen, int) or seen < -1 or not isinstance(judged, int) or judged < -1 or \
                not isinstance(anomalies, list) or not all(isinstance(s, int) and s >= 0 for s in anomalies):
            raise ValueError(f"malformed agreement report {text[:200]!r}")
        return cls(tuple(sorted(set(held))), seen, judged, tuple(sorted(set(anomalies))))


@dataclass(frozen=True)
class Verdict:
    """The job's agreement: ``agreed``, the newest step every node holds (-1: none);
    ``abandoned``, the newer steps some node finished with without holding them."""

    agreed: int = -1
    abandoned: tuple[int, ...] = ()
    #: ``recovery.prefer: certified``: the newest certified step, the step watched next, the newest
    #: iteration judged (-1: none)
    certified: int = -1
    watched: int = -1
    judged: int = -1

    def __repr__(self) -> str:
        more = (f", certified={self.certified}, watched={self.watched}, judged={self.judged}"
                if self.judged >= 0 else "")
        return f"Verdict(agreed={self.agreed}, abandoned={self.abandoned}{more})"

    def resolves(self, step: int) -> bool:
        """Whether a pending version of ``step`` is resolved (agreed, older than the agreed step,
        or abandoned): its slot may be reused."""
        return step <= self.agreed or step in self.abandoned

    def encode(self) -> str:
        rec = {"v": FORMAT, "agreed": self.agreed, "abandoned": list(self.abandoned)}
        if self.judged >= 0:
            rec.update(certified=self.certified, watched=self.watched, judged=self.judged)
        return json.dumps(rec, separators=(",", ":"))

    @classmethod
    def decode(cls, text: Optional[str]) -> "Verdict":
        if not text:
            return cls()
        rec = json.loads(text)
        if not isinstance(rec, dict) or rec.get("v") != FORMAT:
            raise ValueError(f"agreement verdict of format {rec.get('v') if isinstance(rec, dict) else rec!r}, "
                             f"this version reads {FORMAT}")
        return cls(int(rec["agreed"]), tuple(int(s) for s in rec["abandoned"]), int(rec.get("certified", -1)),
                   int(rec.get("watched", -1)), int(rec.get("judged", -1)))


class Aggregator:
    """The job's verdict from the nodes' reports, kept incrementally: :meth:`update` costs
    O(log N + S) (S: distinct steps held anywhere newer than the agreed one), never O(N).
    ``nodes``: how many nodes must report before any step is agreed; ``certify_after`` (``recovery.prefer:
    certified``): the certifier's window, fed with the iterations every node judged. Not thread-safe: its
    owner (the root's store, under its map's lock) serialises the calls."""

    def __init__(self, nodes: int, certify_after: Optional[int] = None):
        if nodes < 1:
            raise ValueError(f"nodes={nodes}: an agreement needs at least one node")
        self.nodes = nodes
        self.reports: dict[int, NodeReport] = {}
        self._holding: dict[int, int] = {}  # step -> nodes holding it
        self._seen: list[int] = []  # every reporting node's seen, sorted
        self._judged: list[int] = []  # every reporting node's judged, sorted
        self._anomalies: dict[int, int] = {}  # iteration -> nodes listing it
        self.certifier = JobCertifier(certify_after) if certify_after is not None else None
        self._verdict = Verdict()

    def update(self, node: int, report: NodeReport) -> Verdict:
        """Node ``node``'s new report; the verdict after it."""
        old = self.reports.get(node)
        if old == report:
            return self._verdict
        if old is not None:
            self._remove(old)
        for s in report.held:
            self._holding[s] = self._holding.get(s, 0) + 1
        for it in report.anomalies:
            self._anomalies[it] = self._anomalies.get(it, 0) + 1
        bisect.insort(self._seen, report.seen)
        bisect.insort(self._judged, report.judged)
        self.reports[node] = report
        self._verdict = self._decide()
        return self._verdict

    def _remove(self, old: NodeReport) -> None:
        for counts, keys in ((self._holding, old.held), (self._anomalies, old.anomalies)):
            for s in keys:
                counts[s] -= 1
                if not counts[s]:
                    del counts[s]
        del self._seen[bisect.bisect_left(self._seen, old.seen)]
        del self._judged[bisect.bisect_left(self._judged, old.judged)]

    def forget(self, node: int) -> Verdict:
        """Node ``node`` left the job (its report no longer counts); the verdict after it."""
        old = self.reports.pop(node, None)
        if old is not None:
            self._remove(old)
            self._verdict = self._decide()
        return self._verdict

    def verdict(self) -> Verdict:
        return self._verdict

    def _decide(self) -> Verdict:
        everyone = len(self.reports) >= self.nodes
        agreed = max((s for s, n in self._holding.items() if n >= self.nodes), default=-1) if everyone else -1
        abandoned = tuple(sorted(
            s for s, n in self._holding.items()
            if s > agreed and len(self._seen) - bisect.bisect_left(self._seen, s) > n))
        c = self.certifier
        if c is None:
            return Verdict(agreed, abandoned)
        if everyone and self._judged[0] > c.judged:  # every node judged further: the certifier goes on
            c.advance(self._judged[0], self._anomalies, agreed)
        return Verdict(agreed, abandoned, c.certified, c.watched, c.judged)


def decide(reports: dict[int, NodeReport], nodes: int) -> Verdict:
    """The verdict of ``reports`` from scratch (the definition :class:`Aggregator` keeps
    incrementally; the property tests compare the two).

    >>> decide({0: NodeReport((4, 5), 5), 1: NodeReport((4,), 6)}, nodes=2)
    Verdict(agreed=4, abandoned=(5,))
    """
    if len(reports) < nodes:
        agreed = -1
    else:
        common: Optional[set[int]] = None
        for r in reports.values():
            common = set(r.held) if common is None else common & set(r.held)
        agreed = max(common or (), default=-1)
    steps = {s for r in reports.values() for s in r.held if s > agreed}
    abandoned = tuple(sorted(s for s in steps if any(r.seen >= s and s not in r.held for r in reports.values())))
    return Verdict(agreed, abandoned)


def node_report(clean: dict[int, Iterable[int]], seen: dict[int, int], ranks: int) -> NodeReport:
    """A node's report from its ranks' clean steps and finished steps; until all ``ranks`` local
    ranks registered, it holds nothing and has seen nothing (no step is agreed without them).

    >>> node_report({0: [3, 4], 1: [4, 5]}, {0: 4, 1: 5}, ranks=2)
    NodeReport(held=(4,), seen=4)
    >>> node_report({0: [3, 4]}, {0: 4}, ranks=2)
    NodeReport(held=(), seen=-1)
    """
    if len(clean) < ranks or not clean:
        return NodeReport()
    common: Optional[set[int]] = None
    for steps in clean.values():
        common = set(steps) if common is None else common & set(steps)
    return NodeReport(tuple(sorted(common or ())), min(seen.get(r, -1) for r in clean))


def resolved(step: int, verdict: Verdict, clean: dict[int, Iterable[int]], seen: dict[int, int]) -> bool:
    """Whether a node's version of ``step`` is resolved: by the job's ``verdict``, or already on this
    node, where a local rank finished with ``step`` without holding it (``clean``, ``seen``: the local
    ranks' clean steps and finished steps). The job's verdict cannot say the latter: the node's report
    holds only the steps *every* local rank holds.

    >>> resolved(14, Verdict(agreed=3), {0: [14, 3], 1: [15, 3]}, {0: 15, 1: 15})
    True
    >>> resolved(15, Verdict(agreed=3), {0: [14, 3], 1: [15, 3]}, {0: 14, 1: 15})
    False
    """
    return verdict.resolves(step) or any(seen.get(r, -1) >= step and step not in set(steps)
                                         for r, steps in clean.items())
