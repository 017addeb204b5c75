"""Named points on the snapshot path where a test harness may make a process fail.

The runtime announces each point it passes with :func:`reached` (the trainer: ``before-snapshot``,
``mid-copy``, ``after-commit``, ``restore``; the agent: ``mid-exchange``). Nothing happens unless a
harness gave this process an :class:`Injector` with :func:`install` (megatron-ft's own is
:mod:`megatron_ft.testing.faults`, installed by its command-line wrapper before the training script
or the agent runs). The runtime never reads a fault from the environment and never imports the
harness.

=================  =========  =================================================================
point              process    where
=================  =========  =================================================================
before-snapshot    trainer    iteration ``step`` finished, its snapshot not started
mid-copy           trainer    the snapshot of ``step`` copied its first piece of bytes, not the rest
after-commit       trainer    the agent marked the snapshot of ``step`` clean; context: ``area``
                              (the committed bytes, writable), ``path`` and ``size`` (the slot file)
restore            trainer    a restore chose ``step`` (every rank listed it): about to open and check it
mid-exchange       agent      the first contribution of version ``step`` left this node, not the rest
=================  =========  =================================================================
"""
from __future__ import annotations

from typing import Any, Optional, Protocol

POINTS = ("before-snapshot", "mid-copy", "after-commit", "restore", "mid-exchange")


class Injector(Protocol):
    def reached(self, point: str, step: int, rank: int, **context: Any) -> None:
        """Called at ``point`` of ``step`` on ``rank`` (-1 in the agent); may kill the process."""


_injector: Optional[Injector] = None


def install(injector: Optional[Injector]) -> None:
    """Give this process an injector (``None`` removes it)."""
    global _injector
    _injector = injector


def reached(point: str, step: int, rank: int = -1, **context: Any) -> None:
    """Announce ``point``: a no-op unless an injector is installed."""
    if _injector is not None:
        _injector.reached(point, step, rank, **context)
