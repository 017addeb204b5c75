"""The agent's side of the job-wide agreement (:mod:`.agreement` has the rule): it publishes this
node's report, aggregates the reports where it is the root, and learns the job's verdict.

Threads (both daemons, started by :meth:`JobAgreement.start`, ended by :meth:`close`):

* ``agree-report``: sends the node's newest report (:meth:`report` only hands it over: the agent
  calls it under its own lock, and no store call is ever made under that lock). Without a store
  (a one-node job) :meth:`report` aggregates the report itself and protects the verdict at once, and
  this thread runs ``after``.
* ``agree-verdict`` (with a store): waits for the job's verdict to change (the store's ``watch``,
  a long poll of at most ``poll_s``) and applies it. A store that does not answer is asked again
  after ``poll_s`` (the heartbeat thread finds a new root meanwhile).

The root aggregates in process: the embedded store derives the verdict key from every report set
on the root's own server (:meth:`~megatron_ft.health.wire_store.KVServer.derive`), so a report
costs the root one dictionary update and the watchers are woken at once. etcd has no such hook:
the root agent reads the reports once (one range read of ``agree/``), then follows them on one etcd
watch stream of that prefix, folding each report as it arrives and writing the verdict when it changes
(thread ``agree-root``).

Messages per agreed step (N nodes): N reports in, one verdict out to each of N watchers: 2N, two
rounds, constant per node; on etcd the root's stream carries the N reports to it besides (no read of
N keys per period).

The agent's two hooks: ``protect(verdict)`` makes the verdict this node's (:attr:`verdict` is set
there, together with the protection of the agreed version, under the agent's lock: a ``begin`` never
sees a step resolved whose agreed successor is not protected yet); ``after()`` does what follows
outside that lock (the exchange and the persist of the agreed step). ``protect`` is called on the
verdict thread, or (one-node job) on the caller of :meth:`report`, which holds the agent's
re-entrant lock; ``after`` on this class's threads, never under a lock of this class.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

import time

from . import reductions
from .agreement import REPORT_KEY, VERDICT_KEY, Aggregator, NodeReport, Verdict

log = logging.getLogger("megatron_ft.agent")


class JobAgreement:
    """``store``: the job's store (None: a one-node job, decided here); ``protect``, ``after``: the
    agent's hooks (above); ``poll_s``: the longest a watch waits before it asks again."""

    def __init__(self, node: int, nodes: int, store, protect: Callable[[Verdict], None],
                 after: Callable[[], None], poll_s: float = 1.0, certify_after: Optional[int] = None):
        self.node, self.nodes, self.store, self.poll_s = node, nodes, store, poll_s
        self.protect, self.after = protect, after
        self.verdict = Verdict()  # set by ``protect``
        self._after_due = False
        self.reports_sent = 0  # counted for the scale benchmark
        self.verdicts_seen = 0
        self._pending: Optional[NodeReport] = None
        self._sent: Optional[NodeReport] = None
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._local = Aggregator(nodes, certify_after) if store is None else None
        self._root_agg = Aggregator(nodes, certify_after)  # used where this node's own server is the root's
        self._root_red = reductions.Accumulator(nodes)
        self._threads: list[threading.Thread] = []
        #: job-wide decisions go through the agents (:meth:`decide`): one node, or a store that derives keys
        self.decides = store is None or hasattr(store, "derive")
        self.decisions_sent = 0
        if store is not None and hasattr(store, "derive"):
            store.derive(REPORT_KEY, self._derive)
            store.derive(reductions.PREFIX, self._derive_reduction)

    def start(self) -> "JobAgreement":
        """Start the report and verdict threads (and, on etcd, the root's). On the embedded store two root
        connections are kept for this agreement's watches: the verdict's long poll and a decision's."""
        targets = [("agree-report", self._report_loop)]
        if hasattr(self.store, "reserve_watchers"):
            self.store.reserve_watchers(2)
        if self.store is not None:
            targets.append(("agree-verdict", self._verdict_loop))
            if not hasattr(self.store, "derive"):
                targets.append(("agree-root", self._root_loop))
        for name, fn in targets:
            t = threading.Thread(target=fn, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    # ------------------------------------------------------------------ the node's report
    def report(self, report: NodeReport) -> None:
        """This node's newest report (non-blocking; a report superseded before it was sent is dropped)."""
        if self._local is not None:  # a one-node job: decided here, at once
            verdict = self._local.update(self.node, report)
            if verdict != self.verdict:
                self.protect(verdict)
                with self._cond:
                    self._after_due = True
                    self._cond.notify()
            return
        with self._cond:
            if report == self._sent and self._pending is None:
                return
            self._pending = report
            self._cond.notify()

    def _report_loop(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                while self._pending is None and not self._after_due and not self._stop.is_set():
                    self._cond.wait(self.poll_s)
                report, self._pending = self._pending, None
                after, self._after_due = self._after_due, False
            if after:
                self.after()
            if report is None:
                continue
            try:
                self.store.publish(f"{REPORT_KEY}{self.node}", report.encode())
                self._sent = report
                self.reports_sent += 1
            except Exception as e:  # the store moving: send it again once it answers
                log.warning("agent node %d: could not report to the job's agreement (%s); again in %.1f s",
                            self.node, e, self.poll_s)
                with self._cond:
                    if self._pending is None:
                        self._pending = report
                self._stop.wait(self.poll_s)

    # ------------------------------------------------------------------ the job's verdict
    def _verdict_loop(self) -> None:
        known: Optional[str] = None
        while not self._stop.is_set():
            try:
                value = self.store.watch(VERDICT_KEY, known, self.poll_s)
            except Exception as e:
                log.debug("agent node %d: watching the verdict: %s", self.node, e)
                self._stop.wait(self.poll_s)
                continue
            if value == known or value is None:
                continue
            known = value
            try:
                verdict = Verdict.decode(value)
            except (ValueError, KeyError, TypeError) as e:
                log.error("agent node %d: ignored a malformed agreement verdict %r: %s", self.node, value[:200], e)
                continue
            self.verdicts_seen += 1
            self._learn(verdict)

    def _learn(self, verdict: Verdict) -> None:
        if verdict != self.verdict:
            self.protect(verdict)
            self.after()

    # ------------------------------------------------------------------ the root's aggregation
    def _derive(self, key: str, value: str) -> dict[str, str]:
        """The embedded store's hook on this node's own server (it runs only where reports arrive:
        at the root). Under the store map's lock: quick, no I/O."""
        try:
            node = int(key)
            report = NodeReport.decode(value)
        except ValueError as e:
            log.error("agent node %d (root): ignored the agreement report %r: %s", self.node, key, e)
            return {}
        if not 0 <= node < self.nodes:
            log.error("agent node %d (root): ignored an agreement report from node %d of %d", self.node, node,
                      self.nodes)
            return {}
        return {VERDICT_KEY: self._root_agg.update(node, report).encode()}

    # ------------------------------------------------------------------ job-wide decisions
    def decide(self, key: str, how: str, values: list[int], wait_s: float) -> list[int]:
        """The job's combination of every node's ``values`` for decision ``key`` (:mod:`.reductions`):
        this node's contribution to the root, then the result watched for, at most ``wait_s`` (then
        TimeoutError naming the decision). Blocking; called by the agent once its local ranks are in."""
        if self.store is None:
            return values
        if not self.decides:
            raise RuntimeError("job-wide decisions through the agents need the embedded store (etcd: use the "
                               "collectives)")
        deadline = time.monotonic() + wait_s
        self.store.set(f"{reductions.PREFIX}{key}/{self.node}", reductions.encode(how, values))
        self.decisions_sent += 1
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"job-wide decision {key!r}: not every node's ranks decided within {wait_s:g} s")
            try:
                value = self.store.watch(f"{reductions.PREFIX}{key}", None, min(left, self.poll_s * 10))
            except Exception as e:  # the store moving: once it answers, the contribution again (a new
                # root never saw it; the old one's result, if any, ignores it), then ask again
                log.warning("agent node %d: waiting for the decision %r: %s", self.node, key, e)
                self._stop.wait(min(self.poll_s, max(0.0, deadline - time.monotonic())))
                try:
                    self.store.set(f"{reductions.PREFIX}{key}/{self.node}", reductions.encode(how, values))
                except Exception:
                    pass
                continue
            if value is not None:
                return reductions.decode(value)[1]

    def _derive_reduction(self, key: str, value: str) -> dict:
        """The root's hook for a node's contribution ``red/<decision>/<node>``: absorbed (its key deleted),
        the result set with the last node's. Under the store map's lock: quick, no I/O."""
        decision, _, node_s = key.rpartition("/")
        full = f"{reductions.PREFIX}{key}"
        try:
            node = int(node_s)
            how, values = reductions.decode(value)
            if not 0 <= node < self.nodes or not reductions.KEY_RE.match(decision):
                raise ValueError(f"node {node} of {self.nodes}, decision {decision!r}")
            result = self._root_red.add(decision, node, how, values)
        except ValueError as e:
            log.error("agent node %d (root): ignored the decision contribution %r: %s", self.node, key, e)
            return {full: None}
        out: dict = {full: None}
        if result is not None:
            out[f"{reductions.PREFIX}{decision}"] = reductions.encode(how, result)
        for old in self._root_red.finished_dropped:
            out[f"{reductions.PREFIX}{old}"] = None
        self._root_red.finished_dropped.clear()
        return out

    def _root_loop(self) -> None:
        """A store without a hook (etcd): where this agent is the root, the reports are read once (one
        range read of ``agree/``) and then followed on one etcd watch stream of that prefix, each event
        folded into an :class:`Aggregator` and a changed verdict written at once - no read of the N
        reports per period. A broken or compacted stream, or the root role regained, reads them again."""
        agg: Optional[Aggregator] = None
        rev, last = 0, None
        while not self._stop.is_set():
            try:
                if not self.store.is_root:
                    agg = None
                    self._stop.wait(self.poll_s)
                    continue
                if agg is None:
                    rev, keys = self.store.kv.read_prefix(REPORT_KEY)
                    agg = Aggregator(self.nodes)  # (etcd: no certification at the root yet)
                    for key, value in keys.items():
                        self._fold(agg, key[len(REPORT_KEY):], value)
                    last = self._publish(agg, last)
                for ev in self.store.kv.events(REPORT_KEY, rev + 1, max(2.0, 4 * self.poll_s), prefix=True,
                                               stop=self._stop):
                    rev = ev.rev
                    self._fold(agg, ev.key[len(REPORT_KEY):], ev.value)
                    last = self._publish(agg, last)
                    if not self.store.is_root:
                        break
            except Exception as e:  # etcd unavailable, a stream broken or compacted: read them again
                log.debug("agent node %d: aggregating the agreement: %s", self.node, e)
                agg = None
                self._stop.wait(self.poll_s)

    def _fold(self, agg: Aggregator, node_s: str, value: Optional[str]) -> None:
        """One node's report (None: its key deleted) into the root's aggregator."""
        try:
            node = int(node_s)
            if not 0 <= node < self.nodes:
                raise ValueError(f"node {node} of {self.nodes}")
            if value:
                agg.update(node, NodeReport.decode(value))
            else:
                agg.forget(node)
        except ValueError as e:
            log.error("agent node %d (root): ignored the agreement report of %r: %s", self.node, node_s, e)

    def _publish(self, agg: Aggregator, last: Optional[str]) -> str:
        verdict = agg.verdict().encode()
        if verdict != last:
            self.store.set(VERDICT_KEY, verdict)
        return verdict

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for t in self._threads[:1]:  # the reporting thread; a watch still waiting (daemon threads) ends
            t.join(timeout=0.5)     # with the store's connections, which its owner closes next
