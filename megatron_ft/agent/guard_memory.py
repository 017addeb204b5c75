"""The guard's memory on the agent (:mod:`megatron_ft.trainer.guard`): each local rank's losses of its
newest committed steps, the versions it refused since the guard last passed, and the steps it certified.

Kept across trainer restarts (a restarted trainer judges its restored version against them), lost
with the agent. Owns its own lock, innermost: taken alone or under ``SlotStore.lock``, nothing is
taken under it; no I/O.
"""
from __future__ import annotations

import threading

#: losses (and certified steps) kept per rank for the guard after a restore (the newest committed steps')
LOSS_HISTORY = 64


class GuardMemory:
    """One node's guard memory (see the module). Not collective: each call concerns one local rank.

    >>> g = GuardMemory()
    >>> g.record(0, 5, 2.5); g.refused(0), g.refused(0)
    (1, 2)
    >>> g.certified(0, 5), g.history(0)
    ([5], {'losses': {'5': 2.5}, 'rollbacks': 0})
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.losses: dict[int, dict[int, float]] = {}  # rank -> {step: loss} of its newest committed steps
        self.rollbacks: dict[int, int] = {}  # rank -> versions refused since the guard last passed
        self.certified_steps: dict[int, set[int]] = {}  # rank -> steps certified (the newest LOSS_HISTORY)

    def record(self, rank: int, step: int, loss: float) -> None:
        """``rank`` committed ``step`` with training loss ``loss`` (the oldest beyond LOSS_HISTORY forgotten)."""
        with self.lock:
            history = self.losses.setdefault(rank, {})
            history[step] = loss
            for old in sorted(history)[:-LOSS_HISTORY]:
                del history[old]

    def refused(self, rank: int) -> int:
        """The guard of ``rank`` refused a version: the rollbacks counted since it last passed."""
        with self.lock:
            self.rollbacks[rank] = self.rollbacks.get(rank, 0) + 1
            return self.rollbacks[rank]

    def certified(self, rank: int, step: int) -> list[int]:
        """``rank`` certified ``step``: its rollbacks are forgiven (the limit is per incident, not per
        job); the newest 8 certified steps."""
        with self.lock:
            steps = self.certified_steps.setdefault(rank, set())
            steps.add(step)
            for old in sorted(steps)[:-LOSS_HISTORY]:
                steps.discard(old)
            self.rollbacks[rank] = 0
            return sorted(steps)[-8:]

    def history(self, rank: int) -> dict:
        """The ``losses`` op's reply: ``rank``'s recorded losses and its rollbacks."""
        with self.lock:
            return {"losses": {str(k): v for k, v in sorted(self.losses.get(rank, {}).items())},
                    "rollbacks": self.rollbacks.get(rank, 0)}
