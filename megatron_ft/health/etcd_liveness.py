"""Failure verdicts on etcd from leases and a watch, not from heartbeats every agent reads.

With ``health.store: etcd://...`` each agent's liveness is its etcd lease
(:class:`~megatron_ft.health.etcd.EtcdStore`: granted at connect, kept alive every ``ttl_s / 3``,
``alive/<node:06d>`` attached to it) and the root is the holder of the lease-bound ``root`` key.
:class:`EtcdLiveness` is the agent's monitor on such a store (the embedded store's is
:class:`~megatron_ft.health.monitor.Monitor`, whose verdict records, their withdrawal and the
stand-down of a fenced agent it shares):

* **every agent** writes ``hb/<node>`` (``{"pid", "seq", "time", "launcher", "addr", "trained"}``, the
  owners the job record carries: :mod:`.job_record`) when it starts and when its ``launcher`` or
  ``trained`` field changes - checked every ``heartbeat_s`` without a store call - and at no other
  time: liveness is the lease, so every ``hb/`` event a job record reader's watch carries
  (:mod:`.job_view_etcd`) is a change of the record. ``hb/`` is not lease-bound: a lost node's last
  record stays readable, as on the embedded store;
* **the root** (thread ``etcd-verdicts``, while :attr:`EtcdStore.is_root`) reads ``alive/``, ``hb/``
  and ``failed/`` once (three range reads) and then follows ``alive/`` on one watch stream. A DELETE
  of ``alive/<n>`` - etcd deleting it when node ``n``'s lease expired, ``ttl_s`` after its last
  refresh - is the *hardware* verdict ``failed/<n>`` (plus ``last_verdict``), the same JSON as on the
  embedded store; a PUT (a new agent of that node, or the judged one come back after a pause)
  withdraws it as :meth:`Monitor._clear_verdict` does. A node with a ``hb/`` record but no live
  ``alive/`` key when the root took over is judged if no ``alive/`` key of it appears within
  ``ttl_s``; the watch of a root that took a vacated ``root`` starts at the revision it was vacated
  at, so the old root's loss (and any since) is a DELETE on it, judged at once;
* **an agent whose own lease expired** (it did not run, or reach etcd, for ``ttl_s``) takes a new
  one (:meth:`EtcdStore.on_new_lease`) and, for ``2 * ttl_s + 1`` s after, reads its ``failed/``
  record every ``ttl_s / 3``: judged meanwhile and claimed by a standby, it stands down
  (``fenced``), as :meth:`Monitor._check_fenced` decides.

Requests per agent: the keepalive every ``ttl_s / 3``, an ``hb/`` put per change of its owners, the
``root`` watch reopened every :data:`EtcdStore.ROOT_WATCH_S`; the root adds its ``alive/`` watch, reopened every
``ttl_s / 3``, and one read per joining node. None of it grows with the number of nodes.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, Optional

from .etcd import EtcdStore
from .kv import StoreUnavailable
from .monitor import Monitor

log = logging.getLogger("megatron_ft.health")


def monitor_class(store: Any) -> type:
    """The monitor an agent runs on ``store``: :class:`EtcdLiveness` on etcd, else :class:`Monitor`."""
    return EtcdLiveness if isinstance(store, EtcdStore) else Monitor


def _node_of(key: str) -> int:
    """``alive/000012`` or ``hb/12`` -> 12 (-1 for a key of no node)."""
    try:
        return int(key.rsplit("/", 1)[1])
    except (IndexError, ValueError):
        return -1


def _pid(record: Optional[str]) -> Optional[int]:
    try:
        pid = json.loads(record or "")["pid"]
        return int(pid)
    except (ValueError, KeyError, TypeError):
        return None


class EtcdLiveness(Monitor):
    """The agent's monitor on an :class:`EtcdStore` (see the module); :class:`Monitor`'s constructor
    and interface (``start``, ``stop``, ``beat``, ``report_software``, ``failed``). Threads: the
    ``heartbeat`` thread (every ``heartbeat_s``: ``hb/`` when due, starts the verdict thread when this
    agent becomes root, the fence check after a new lease) and ``etcd-verdicts`` (root only; ends
    within ``ttl_s / 3`` once this agent is no longer root or the monitor stopped). The root's verdict
    state (``failed`` and the rest of :class:`Monitor`'s) is touched by the verdict thread only."""

    def __init__(self, store: EtcdStore, *args, **kw):
        super().__init__(store, *args, **kw)
        self.refresh_s = store.refresh_s
        self.ttl_s = store.ttl_s
        self._hb: tuple[Any, float] = (None, float("-inf"))  # (launcher, trained) last written, when
        self._verdicts: Optional[threading.Thread] = None
        self._fence_until = 0.0  # monotonic: check our failed/ record until then (after a new lease;
        # the check is idempotent: a verdict withdrawn once stays withdrawn, one claimed stays claimed)
        self._fence_checked = float("-inf")
        store.on_new_lease(self._new_lease)

    def _new_lease(self) -> None:
        """Our lease expired (we did not run, or reach etcd): the root may have judged us lost."""
        self._fence_until = time.monotonic() + 2 * self.ttl_s + 1

    def beat(self) -> None:
        """One tick: ``hb/<node>`` when its owners changed; the verdict thread when root; the fence check
        when due."""
        now = time.monotonic()
        fields = (self.launcher_pid(), self.trained())
        if fields != self._hb[0]:
            self.seq += 1
            self.store.set(f"hb/{self.node}", json.dumps({"pid": os.getpid(), "seq": self.seq, "time": time.time(),
                                                             "launcher": fields[0], "addr": self.address,
                                                             "trained": fields[1]}))
            self._hb = (fields, now)
        if self.store.is_root and (self._verdicts is None or not self._verdicts.is_alive()):
            self._verdicts = threading.Thread(target=self._verdict_loop, name="etcd-verdicts", daemon=True)
            self._verdicts.start()
        if now < self._fence_until and now - self._fence_checked >= self.refresh_s:
            self._fence_checked = now
            self._check_fenced()

    # ------------------------------------------------------------------ the root's verdicts

    def _verdict_loop(self) -> None:
        """While root: the scan, then the watch on ``alive/`` (see the module); a broken watch is
        scanned and watched again after ``ttl_s / 3``."""
        log.info("root: node %d watches the agents' etcd leases", self.node)
        while not self._stop.is_set() and self.store.is_root:
            try:
                rev, alive, suspects = self._scan()
                while not self._stop.is_set() and self.store.is_root:
                    wait = self.refresh_s
                    if suspects:
                        wait = max(0.05, min(wait, min(d for _, d in suspects.values()) - time.monotonic()))
                    until = time.monotonic() + wait
                    for ev in self.store.kv.events("alive/", rev + 1, wait, prefix=True, prev=True, stop=self._stop):
                        rev = ev.rev
                        self._seen_alive(ev, alive, suspects)
                        if time.monotonic() >= until or not self.store.is_root:
                            break  # a busy stream: look at the suspects and our role all the same
                    now = time.monotonic()
                    for n, (pid, deadline) in list(suspects.items()):
                        if now >= deadline:
                            del suspects[n]
                            if self.failed.get(n, {}).get("pid") != pid:
                                self._judge(n, pid, f"no liveness lease for {self.ttl_s} s (none when node "
                                                    f"{self.node} became root)")
            except StoreUnavailable as e:
                if self._stop.is_set():
                    break
                log.warning("root: node %d: watching the agents' leases: %s", self.node, e)
                self._stop.wait(self.refresh_s)
        log.info("root: node %d no longer watches the agents' leases", self.node)

    def _scan(self) -> tuple[int, dict[int, int], dict[int, tuple[int, float]]]:
        """At the start of the watch: the live nodes (``alive/``, and the revision to watch from), the
        verdicts already written, and the nodes that wrote ``hb/`` but have no live lease (suspects,
        with the time they are judged at)."""
        vacated, self.store.vacated_rev = self.store.vacated_rev, 0  # once: etcd may have compacted it away
        rev, keys = self.store.kv.read_prefix("alive/")
        alive = {n: p for k, v in keys.items() if (n := _node_of(k)) >= 0 and (p := _pid(v)) is not None}
        _, beats = self.store.kv.read_prefix("hb/")
        _, verdicts = self.store.kv.read_prefix("failed/")
        judged = {n: _pid(v) for k, v in verdicts.items() if (n := _node_of(k)) >= 0}
        for n, pid in alive.items():
            if n in judged:
                self._clear_verdict(n, pid)
            else:
                self._pids[n] = pid
        deadline = time.monotonic() + self.ttl_s
        suspects = {}
        for k, v in beats.items():
            n, pid = _node_of(k), _pid(v)
            if n < 0 or n == self.node or n in alive or pid is None:
                continue
            if judged.get(n) == pid:
                self.failed.setdefault(n, json.loads(verdicts[f"failed/{n}"]))
            else:
                suspects[n] = (pid, deadline)
        # where root was vacated, watch from there: the old root's own loss (its alive/ key went with
        # ``root``) and any node lost since are DELETEs on the watch, judged at once
        return (min(rev, vacated - 1) if vacated else rev), alive, suspects

    def _seen_alive(self, ev, alive: dict[int, int], suspects: dict[int, tuple[int, float]]) -> None:
        n = _node_of(ev.key)
        if n < 0:
            return
        if ev.kind == "PUT":
            pid = _pid(ev.value)
            if pid is None:
                return
            alive[n] = pid
            suspects.pop(n, None)
            self._clear_verdict(n, pid)
            return
        pid = alive.pop(n, None) or _pid(ev.prev)
        suspects.pop(n, None)
        if n == self.node or pid is None:
            return  # our own lease lapsed: we did not run; we are not root any more
        if self.failed.get(n, {}).get("pid") == pid:
            return
        self._judge(n, pid, f"its liveness lease expired (no keepalive for {self.ttl_s} s)")
