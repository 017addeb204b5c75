"""Which versions are *certified* (``recovery.prefer: certified``): the job trained past them with no
loss anomaly (pure: no I/O, no locks, no clocks).

:class:`Certifier` decides from one verdict per iteration (anomalous or not) and the newest agreed
step. With the agents' agreement it runs once, at the root (:class:`JobCertifier` inside
:class:`~.agreement.Aggregator`): every node reports the newest iteration all its ranks judged and the
iterations any of them found anomalous; the root feeds the certifier every iteration every node has
judged, in order, and its verdict carries the certified and the watched step to every agent. With the
collective agreement each trainer runs one, fed by an all-reduce per iteration.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

__all__ = ["Certification", "Certifier", "JobCertifier"]


@dataclass
class Certification:
    """What :meth:`Certifier.iteration` decided: the step now certified, the step to watch next
    (each ``None`` for nothing new)."""

    certify: Optional[int] = None
    watch: Optional[int] = None


class Certifier:
    """Which versions are *certified* (``recovery.prefer: certified``): a pure state machine, fed every
    iteration's verdict (the same on every rank: the ranks all-reduce it) and the newest step the job
    agreed on.

    A version is watched - its slot kept - from the iteration it is agreed on; once the job trained
    ``after`` iterations past it with no anomaly it is certified and the newest agreed version is
    watched next. An anomaly drops the watched version (never certified); the next one watched is
    taken at or after the anomalous iteration, so its own window comes after it.

    >>> c = Certifier(after=2)
    >>> c.iteration(1, False, agreed=1)          # version 1 agreed: watch it
    Certification(certify=None, watch=1)
    >>> c.iteration(2, False, agreed=2)
    Certification(certify=None, watch=None)
    >>> c.iteration(3, False, agreed=3)          # 2 and 3 clean: 1 certified, watch 3
    Certification(certify=1, watch=3)
    >>> c.iteration(4, True, agreed=4)           # the loss of iteration 4 was an anomaly: 3 dropped
    Certification(certify=None, watch=4)
    >>> [c.iteration(i, False, agreed=i) for i in (5, 6)][-1]
    Certification(certify=4, watch=6)
    """

    def __init__(self, after: int, certified: int = -1):
        self.after = after
        self.certified = certified
        self.watched: Optional[int] = None
        self.last_anomaly = -1

    def passed(self, step: int) -> None:
        """``step`` was certified elsewhere (the guard after restoring it)."""
        self.certified = max(self.certified, step)
        if self.watched is not None and self.watched <= step:
            self.watched = None

    def iteration(self, iteration: int, anomalous: bool, agreed: int) -> Certification:
        out = Certification()
        if anomalous:
            self.last_anomaly = iteration
            self.watched = None
        elif self.watched is not None and iteration - self.watched >= self.after:
            out.certify = self.certified = self.watched
            self.watched = None
        if self.watched is None and agreed > self.certified and agreed >= self.last_anomaly:
            out.watch = self.watched = agreed
        return out


class JobCertifier:
    """The root's certifier over the nodes' reports: :meth:`advance` feeds :class:`Certifier` every
    iteration up to the newest one every node judged (once each, in order), anomalous where some node
    listed it; it keeps the newest certified and watched steps.

    >>> jc = JobCertifier(after=2)
    >>> jc.advance(judged=1, anomalies=(), agreed=1)   # 1 agreed and watched at iteration 1
    >>> jc.advance(judged=3, anomalies=(), agreed=3)   # two clean iterations past it: certified, 3 watched
    >>> jc.certified, jc.watched, jc.judged
    (1, 3, 3)
    >>> jc.advance(judged=4, anomalies=(4,), agreed=4); jc.watched
    4
    """

    def __init__(self, after: int):
        self.certifier = Certifier(after)
        self.judged = -1  # the newest iteration fed
        self.certified = -1
        self.watched = -1

    def advance(self, judged: int, anomalies: Iterable[int], agreed: int) -> None:
        bad = set(anomalies)
        for it in range(max(self.judged + 1, judged - 10_000), judged + 1):  # (a gap: its last iterations)
            out = self.certifier.iteration(it, it in bad, agreed)
            if out.certify is not None:
                self.certified = out.certify
                if self.watched == out.certify:
                    self.watched = -1
            if out.watch is not None:
                self.watched = out.watch
            if self.certifier.watched is None:
                self.watched = -1
        self.judged = max(self.judged, judged)
