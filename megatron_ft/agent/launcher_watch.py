"""The agent's watch on its node's launcher: when the launcher dies the agent is an orphan; a
restarted launcher adopts it (``adopt`` op) within ``launch.start_timeout_s``, else the agent shuts
down and removes its segments, so nothing outlives a node whose launcher is gone. An orphan also
shuts down as soon as the job is over (:class:`JobEndWatch`, pure, fed the job record: one read of
the record's two index keys, and the parts that changed, per ``poll_s`` while orphaned - not every
node's heartbeat).

Owns the launcher's pid and the orphan flag under ``LauncherWatch.lock`` (innermost: nothing is
taken under it). The watch thread reads the store (never under a lock) and calls the agent's
``shutdown`` with no lock held. Not collective.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Optional

from .. import config as ftconfig

log = logging.getLogger("megatron_ft.agent")


class JobEndWatch:
    """Whether the job an orphaned agent belongs to is over, from the job record
    (:mod:`megatron_ft.health.job_record`; no I/O of its own). Over when a launcher recorded the job's end
    (``ended``, written no earlier than ``health.timeout_s`` before this agent lost its launcher: an older
    record is another job's on a store that outlives jobs), or when every other node has been gone for
    ``timeout_s`` on this agent's clock: judged lost by the root (its agent stopped with its launcher)
    or absent from the record (a new root's, which no agent of it re-filled).

    >>> from megatron_ft.health.job_record import JobRecord, Owners, Failed, Ended
    >>> rec = JobRecord(nodes=2, owners={1: Owners(10, 0)})
    >>> w = JobEndWatch(node=0, nodes=2, timeout_s=5.0, since=100.0)
    >>> w.over(rec, now=101.0), w.over(rec, now=107.0)
    (None, None)
    >>> rec.failed[1] = Failed(10, 101.5)
    >>> w.over(rec, now=108.0), w.over(rec, now=113.5)
    (None, 'nodes [1] gone (judged lost or unknown to the store) for 5 s')
    >>> w.over(JobRecord(nodes=2, ended=Ended(1, 0, 99.0)), now=102.0)
    "node 1's launcher ended the job (exit 0)"
    """

    def __init__(self, node: int, nodes: int, timeout_s: float, since: float):
        self.node, self.nodes, self.timeout_s, self.since = node, nodes, timeout_s, since
        self._gone_since: Optional[float] = None  # our time since when every other node is gone

    def over(self, rec, now: Optional[float] = None) -> Optional[str]:
        """Why the job is over, or None; ``rec``: the job record now (a
        :class:`~megatron_ft.health.job_record.JobRecord`)."""
        now = time.time() if now is None else now
        if rec.ended is not None and rec.ended.time >= self.since - self.timeout_s:
            return f"node {rec.ended.node}'s launcher ended the job (exit {rec.ended.rc})"
        others = [n for n in range(self.nodes) if n != self.node]
        if not others or any(n in rec.owners and n not in rec.failed for n in others):
            self._gone_since = None
            return None
        if self._gone_since is None:
            self._gone_since = now
        if now - self._gone_since >= self.timeout_s:
            return f"nodes {others} gone (judged lost or unknown to the store) for {self.timeout_s:g} s"
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class LauncherWatch:
    """The launcher that owns one node's agent (see the module). ``store``: the agent's coordination
    store now (None before it joined one, or in a one-node job); ``shutdown``: the agent's;
    ``stop``: set when the agent shuts down."""

    def __init__(self, cfg: ftconfig.FTConfig, node: int, stop: threading.Event,
                 shutdown: Callable[[], None], store: Callable[[], Any]):
        self.cfg, self.node, self._stop, self._shutdown, self._store = cfg, node, stop, shutdown, store
        self.lock = threading.Lock()
        self._launcher = 0  # the launcher pid followed (0: none)
        self._orphan = False  # that launcher is gone and no new one adopted this agent yet

    def launcher_pid(self) -> int:
        """The launcher that owns this agent now; 0 while orphaned (or never watched). Lock-free:
        two attribute reads, called by the heartbeat thread."""
        return 0 if self._orphan else self._launcher

    def watch(self, pid: int, poll_s: float = 0.5) -> None:
        """Follow launcher ``pid`` on a thread until the agent stops (see the module)."""
        with self.lock:
            self._launcher = pid
        threading.Thread(target=self._loop, args=(pid, poll_s), name="launcher-watch", daemon=True).start()

    def _loop(self, pid: int, poll_s: float) -> None:
        orphan_since: Optional[float] = None
        watch: Optional[JobEndWatch] = None
        view, view_of = None, None  # the job record's reader, on the store it was made for
        while not self._stop.wait(poll_s):
            with self.lock:
                pid_now = self._launcher
            if _alive(pid_now) and not (pid_now == pid and os.getppid() != pid):
                orphan_since, self._orphan, watch = None, False, None
                continue
            store = self._store()
            if store is not None and view_of is not store:
                from ..health.store import job_view

                view, view_of = job_view(store, self.cfg.cluster.nodes), store
            if orphan_since is None:
                orphan_since = time.time()
                self._orphan = True
                watch = JobEndWatch(self.node, self.cfg.cluster.nodes, self.cfg.health.timeout_s, orphan_since)
                log.warning("agent node %d: launcher pid %d is gone; waiting %.0f s for a new launcher to "
                            "adopt this agent", self.node, pid_now, self.cfg.launch.start_timeout_s)
            elif store is not None and watch is not None and (why := self._over(watch, view)):
                log.warning("agent node %d: the job is over (%s); shutting down instead of waiting for a "
                            "launcher", self.node, why)
                self._shutdown()
                return
            elif time.time() - orphan_since > self.cfg.launch.start_timeout_s:
                log.error("agent node %d: no launcher adopted this agent within launch.start_timeout_s=%g s; "
                          "shutting down", self.node, self.cfg.launch.start_timeout_s)
                self._shutdown()
                return

    @staticmethod
    def _over(watch: JobEndWatch, view) -> Optional[str]:
        """``watch``'s answer on the record as ``view`` reads it now (None also when the store cannot be
        read now: a store moving or gone is no news)."""
        try:
            return watch.over(view.refresh(owners=True))
        except Exception:  # noqa: BLE001 - any store error is no news
            return None

    def adopt(self, pid: int) -> dict:
        """A (restarted) launcher of this node takes this agent over."""
        with self.lock:
            old, self._launcher = self._launcher, pid
            self._orphan = False
        log.info("agent node %d: adopted by launcher pid %d (was %s)", self.node, pid, old)
        return {"node": self.node, "agent_pid": os.getpid()}
