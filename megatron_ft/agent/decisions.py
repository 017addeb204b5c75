"""A node's side of the job-wide decisions of a restore (:mod:`.reductions`): its local ranks' values
gathered, the node's combination sent once through the job agreement, the job's result handed to
every local rank.

Lock: its own condition only (never the slot store's), released across the network wait; the
network call is :meth:`~.job_agreement.JobAgreement.decide`. Collective over the node's local ranks:
each waits until the last one arrived and the job answered.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from . import reductions

#: decisions remembered (the oldest, long answered, forgotten first)
KEPT = 64


@dataclass
class _Decision:
    """A job-wide decision's local side: the local ranks' values, whether the node's combination went
    out, the job's result or why there is none."""
    how: str
    values: dict = field(default_factory=dict)
    sent: bool = False
    result: Optional[list] = None
    error: Optional[str] = None


class NodeDecisions:
    """The decisions of one node's local ranks, keyed by decision (see the module)."""

    def __init__(self, ranks_per_node: int):
        self.ranks_per_node = ranks_per_node
        self._decisions: dict[str, _Decision] = {}
        self._decided = threading.Condition(threading.Lock())

    def decide(self, agreement: Any, rank: int, key: str, how: str, values: list[int], wait_s: float) -> list[int]:
        """``rank``'s values for the job-wide decision ``key``; the job's result. The node's last local
        rank to arrive sends the node's combination through ``agreement`` (a
        :class:`~.job_agreement.JobAgreement` that ``decides``) and waits for the result; the others
        wait for it too, each at most ``wait_s``."""
        if agreement is None or not agreement.decides:
            raise RuntimeError("job-wide decisions through the agents are off here (snapshot.agreement: "
                               "collective, or an etcd store)")
        deadline = time.monotonic() + wait_s
        with self._decided:
            d = self._decisions.get(key)
            if d is None:
                d = self._decisions[key] = _Decision(how)
                while len(self._decisions) > KEPT:
                    del self._decisions[next(iter(self._decisions))]
            if d.how != how:
                raise ValueError(f"decision {key!r}: rank {rank} combines by {how!r}, another local rank by {d.how!r}")
            d.values[rank] = list(values)
            send = len(d.values) >= self.ranks_per_node and not d.sent
            d.sent = d.sent or send
        if send:
            try:
                result = agreement.decide(key, how, reductions.combine(how, list(d.values.values())),
                                          max(0.0, deadline - time.monotonic()))
                with self._decided:
                    d.result = result
                    self._decided.notify_all()
            except Exception as e:
                with self._decided:
                    d.error = f"{type(e).__name__}: {e}"
                    self._decided.notify_all()
        with self._decided:
            while d.result is None and d.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"job-wide decision {key!r}: {len(d.values)} of "
                                       f"{self.ranks_per_node} local ranks arrived within {wait_s:g} s")
                self._decided.wait(left)
            if d.error is not None:
                raise RuntimeError(d.error)
            return list(d.result)
