"""The agent's hang watch: reads its ranks' progress records every ``hang.tick_s``, reports the node's
stall to the job, and ends a rank the job's verdict names hung (SIGKILL: a stuck process may ignore
anything else); the normal recovery follows (the trainer's keeper opens a fast round, the others'
collectives fail, every rank restores from memory). The rule is :mod:`megatron_ft.health.hang`'s.

Thread ``hang-watch`` (daemon, :meth:`HangWatch.start` .. :meth:`close`). Per tick: ``L`` record reads
from shared memory and ``L`` reads of ``/proc/<pid>/stat`` (L = the node's ranks), no message. A node
sends its stall report (``stall/<node>``) only when what it says changes - never while the job trains
- and, while it holds a hung or waiting rank, reads the verdict (``hang``) once a tick. The root's
store derives the verdict from the reports as they arrive (the embedded store's hook); etcd has none,
so there the root agent reads the N reports (one range read of ``stall/``) and writes the verdict, once
a tick while its own node stalls (in a hang every node does): one request per tick at the root, one
read per tick at every other stalled node.
A one-node job decides on its own.

Stragglers: each finished iteration's own work (the iteration less its waits) per rank; a rank over
``hang.straggler_ratio`` x its node's median for ``hang.straggler_iterations`` iterations running is
reported once (log, event, :meth:`status`), and again only after it recovered. Not killed.

A paused agent (SIGSTOP, a long GC, an overloaded host) judges nothing in the first ``floor_s`` after
it runs again: its trainers may have waited for it all that time, in a request they make on the
training thread outside the phases that say so.

Events go to ``$MFT_RUN_DIR/events/node<node>/agent.jsonl`` (``hang``, ``straggler``; beside the node's
ranks' event files, :mod:`megatron_ft.rank_files`) when the launcher names the run directory.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import signal
import statistics
import threading
import time
from typing import Callable, Optional

from .. import rank_files
from ..health import hang as rule
from ..health import progress as hp

log = logging.getLogger("megatron_ft.agent")

#: iteration times kept per node for the bound's p99
WINDOW = 200


#: a process that started this much later than the record it is named in is another one (the pid reused)
PID_REUSE_SLACK_S = 2.0
#: a rank past a fixed deadline (its start, a rendezvous, its restore, a save: :func:`rule.overdue`) is sent
#: SIGUSR1 first - every trainer writes its threads' stacks to its log on it, and it ends the process -
#: and SIGKILL this much later if it still runs (the stacks say where a round that never formed waited)
STACKS_GRACE_S = 1.0


def process_state(pid: int, started: Optional[float] = None) -> Optional[str]:
    """The state letter of ``pid`` (``R``, ``S``, ``D``, ``T`` stopped, ``t`` traced, ``Z``...), None
    when it is gone - or, with ``started`` (``CLOCK_MONOTONIC`` seconds when the record naming it was
    opened), when the process of that pid started after it: the pid was reused by another process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    if not fields:
        return None
    if started is not None and len(fields) > 19:  # field 22 of the file: start time, clock ticks since boot
        if int(fields[19]) / os.sysconf("SC_CLK_TCK") > started + PID_REUSE_SLACK_S:
            return None
    return fields[0][:1]


def alive(pid: int, started: Optional[float] = None) -> bool:
    """Whether ``pid`` still runs (not gone, not a zombie) and is the process of the record naming it."""
    return process_state(pid, started) not in (None, "Z", "X")


class HangWatch:
    """``board``: the node's progress file (the agent owns it); ``store``: the job's (None: a one-node
    job); ``events``: where verdicts are written (None: only the log)."""

    def __init__(self, cfg, node: int, board: hp.ProgressBoard, store, events: Optional[str] = None,
                 now: Callable[[], float] = time.monotonic):
        self.cfg, self.node, self.board, self.store, self.now = cfg, node, board, store, now
        self.hang = cfg.hang
        self.limits = rule.Limits.of(cfg.hang)
        self.rpn = cfg.cluster.ranks_per_node
        self.nodes = cfg.cluster.nodes if store is not None else 1
        self.events = events
        self.iter_times: collections.deque = collections.deque(maxlen=WINDOW)
        self._seen_steps: dict[int, tuple[int, int]] = {}  # rank -> (pid, steps) last counted
        self._stopped_since: dict[int, float] = {}
        self._slow: dict[int, int] = {}  # rank -> iterations over the straggler ratio, running
        self.stragglers: dict[int, dict] = {}
        self.verdicts: list[dict] = []
        self._acted: set[tuple[int, int, int]] = set()
        self._ending: dict[int, tuple[float, float]] = {}  # pid -> (SIGKILL at, its record's start): see STACKS_GRACE_S
        self._sent: Optional[rule.NodeStall] = None
        self._last_tick: Optional[float] = None
        self.training_over = False  # every local rank's record says "done" (read by the heartbeat thread)
        self._quiet_until = 0.0
        self._local = (rule.StallAggregator(1, self.rpn, self.limits.collective_s, self.limits.max_culprits)
                       if store is None else None)
        self._root = rule.StallAggregator(self.nodes, self.rpn, self.limits.collective_s, self.limits.max_culprits)
        self._derives = store is not None and hasattr(store, "derive")
        if self._derives:
            store.derive(rule.STALL_KEY, self._derive)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ the thread
    def start(self) -> "HangWatch":
        self._thread = threading.Thread(target=self._loop, name="hang-watch", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.hang.tick_s):
            try:
                self.tick()
            except Exception as e:  # the watch never takes the agent down
                log.warning("agent node %d: hang watch: %s", self.node, e)

    def close(self, unlink: bool = True) -> None:
        """Stop the thread; the progress file goes with ``unlink`` (an agent that leaves its slots to a
        successor leaves it too: the trainers keep writing there)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self.board.close(unlink=unlink)

    # ------------------------------------------------------------------ one tick
    def tick(self) -> Optional[rule.NodeStall]:
        """Read, judge, report, act. Returns this node's report (for tests)."""
        now = self.now()
        if self._last_tick is not None and now - self._last_tick > 4 * self.hang.tick_s + 1.0:
            self._quiet_until = now + self.limits.floor_s  # this agent was paused: see before judging
            self._stopped_since.clear()
            log.warning("agent node %d: the hang watch did not run for %.1f s (agent paused?): no verdict for "
                        "%.1f s", self.node, now - self._last_tick, self.limits.floor_s)
        self._last_tick = now
        self._end_overdue(now)
        records = {}
        for i in range(self.rpn):
            p = self.board.read(i)
            if p is not None:
                records[self.node * self.rpn + i] = p
        # every local rank wrote "done": this node's training is over (the monitor judges nobody then)
        self.training_over = len(records) == self.rpn and all(p.phase == hp.DONE for p in records.values())
        self._count_iterations(records)
        report = self._judge(records, now)
        if now < self._quiet_until:
            report = rule.NodeStall(self.node, self.rpn, (), ())
        self._send(report)
        if not report.clear:
            verdict = self._verdict(report)
            if verdict is not None:
                self._act(verdict, records, now)
        return report

    def _count_iterations(self, records: dict[int, hp.Progress]) -> None:
        works = {}
        for rank, p in records.items():
            if p.steps < 1 or self._seen_steps.get(rank) == (p.pid, p.steps):
                continue
            self._seen_steps[rank] = (p.pid, p.steps)
            if p.steps > self.limits.warmup_iterations:  # an attempt's first iterations are its warm-up
                self.iter_times.append(p.iter_s)
            works[rank] = p.work_s
        self._stragglers(works, records)

    def _judge(self, records: dict[int, hp.Progress], now: float) -> rule.NodeStall:
        p99_s = rule.p99(list(self.iter_times))
        hung, waiting = [], []
        for rank in range(self.node * self.rpn, (self.node + 1) * self.rpn):
            p = records.get(rank)
            if p is None:
                continue
            state = process_state(p.pid, p.started)
            if state is None or state in "ZX":
                self._stopped_since.pop(rank, None)
                continue
            if state in "Tt":
                stopped_s = now - self._stopped_since.setdefault(rank, now)
            else:
                self._stopped_since.pop(rank, None)
                stopped_s = 0.0
            verdict = rule.judge(p, now, self.limits, p99_s, stopped_s)
            if verdict == "hung":
                hung.append(rule.Culprit(rank, p.pid, p.seq, p.phase_name + (" (stopped)" if stopped_s else ""),
                                         now - p.since, stopped=stopped_s >= self.limits.floor_s))
            elif verdict == "waiting":
                waiting.append(rank)
        long = bool(waiting) and self.limits.collective_s > 0 and all(
            now - records[r].since >= self.limits.collective_s for r in waiting)
        return rule.NodeStall(self.node, self.rpn, tuple(hung), tuple(waiting), long)

    def _send(self, report: rule.NodeStall) -> None:
        """The node's report when it says something new - and its first one, clear or not, so that the
        root forgets what a predecessor of this agent reported last."""
        if report.same(self._sent):
            return
        if self._local is not None:
            self._sent = report
            return
        try:
            self.store.publish(f"{rule.STALL_KEY}{self.node}", report.encode())
            self._sent = report
        except Exception as e:
            log.warning("agent node %d: could not report its stall (%s); again next tick", self.node, e)

    def _verdict(self, report: rule.NodeStall) -> Optional[rule.HangVerdict]:
        if self._local is not None:
            return self._local.update(report)
        try:
            if self._derives or not self.store.is_root:
                text = self.store.get(rule.HANG_KEY)
                return rule.HangVerdict.decode(text) if text else None
            # etcd, at the root, while its own node stalls (in a hang every node does): the N reports in
            # one range read (one request, not one per node)
            _, keys = self.store.kv.read_prefix(rule.STALL_KEY)
            reports = {}
            for key, text in keys.items():
                if text:
                    reports[int(key[len(rule.STALL_KEY):])] = rule.NodeStall.decode(text)
            reports = {n: r for n, r in reports.items() if not r.clear}
            verdict = rule.decide(reports, self.nodes, self.rpn, self.limits.collective_s, self.limits.max_culprits)
            self.store.set(rule.HANG_KEY, verdict.encode() if verdict is not None else "")
            return verdict
        except Exception as e:
            log.warning("agent node %d: reading the hang verdict: %s", self.node, e)
            return None

    def _derive(self, key: str, value: str) -> dict:
        """The root store's hook for ``stall/<node>`` (under the store's lock: no I/O)."""
        try:
            report = rule.NodeStall.decode(value)
            if not 0 <= report.node < self.nodes or str(report.node) != key:
                raise ValueError(f"node {report.node} under key {key!r} of {self.nodes} nodes")
        except (ValueError, KeyError, TypeError) as e:
            log.error("agent node %d (root): ignored the stall report %r: %s", self.node, key, e)
            return {}
        verdict = self._root.update(report)
        return {rule.HANG_KEY: verdict.encode() if verdict is not None else None}

    # ------------------------------------------------------------------ the verdict
    def _targets(self, verdict: rule.HangVerdict, records: dict[int, hp.Progress], now: float,
                 p99_s: Optional[float]) -> list[tuple[int, hp.Progress, str]]:
        """(rank, record, phase as judged) of this node's ranks the verdict ends: those it names whose record
        has not moved since - or, for a verdict on every rank, those of this node's that still qualify (still
        waiting ``collective_s``; still past a deadline of their phase's own), judged again here."""
        if verdict.collective:
            return [(r, p, p.phase_name) for r, p in sorted(records.items())
                    if p.phase in hp.WAITING and now - p.since >= self.limits.collective_s]
        if verdict.overdue:
            return [(r, p, p.phase_name) for r, p in sorted(records.items())
                    if p.phase_name in rule.FIXED_ALLOWANCE and rule.judge(p, now, self.limits, p99_s, 0.0) == "hung"
                    and alive(p.pid, p.started)]
        return [(c.rank, records[c.rank], c.phase) for c in verdict.culprits
                if c.rank in records and (records[c.rank].pid, records[c.rank].seq) == (c.pid, c.seq)]

    def _act(self, verdict: rule.HangVerdict, records: dict[int, hp.Progress], now: float) -> None:
        p99_s = rule.p99(list(self.iter_times))
        for rank, p, phase in self._targets(verdict, records, now, p99_s):
            key = (rank, p.pid, p.seq)
            if key in self._acted:
                continue
            self._acted.add(key)
            stacks = not verdict.collective and phase in rule.FIXED_ALLOWANCE  # a stopped one: "... (stopped)"
            try:
                os.kill(p.pid, signal.SIGUSR1 if stacks else signal.SIGKILL)
            except ProcessLookupError:
                continue
            if stacks:
                self._ending[p.pid] = (now + STACKS_GRACE_S, p.started)
            rec = {"event": "hang", "node": self.node, "rank": rank, "pid": p.pid, "phase": phase,
                   "steps": p.steps, "quiet_s": round(now - p.since, 3), "collective": verdict.collective,
                   "bound_s": round(rule.allowance(self.limits, p.phase, p99_s, p.steps)
                                    or rule.bound(self.limits, p99_s, p.steps), 3),
                   "iteration_p99_s": round(p99_s, 4) if p99_s is not None else None,
                   "others": "waiting, or past a deadline of their own" if stacks else "waiting", "stacks": stacks,
                   "time": time.time()}
            self.verdicts.append(rec)
            log.error("agent node %d: rank %d (pid %d) is hung: quiet %.1f s in %s (bound %.1f s, the job's "
                      "iteration p99 %s s, every other rank %s): %s, the job recovers it", self.node,
                      rank, p.pid, rec["quiet_s"], phase, rec["bound_s"], rec["iteration_p99_s"], rec["others"],
                      f"SIGUSR1 (its stacks to its log), SIGKILL {STACKS_GRACE_S:g} s later if it still runs"
                      if stacks else "SIGKILLed")
            self._event(rec)

    def _end_overdue(self, now: float) -> None:
        """SIGKILL the ranks sent SIGUSR1 for their stacks that still run :data:`STACKS_GRACE_S` later."""
        for pid, (at, started) in list(self._ending.items()):
            if now < at:
                continue
            del self._ending[pid]
            if alive(pid, started):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    # ------------------------------------------------------------------ stragglers
    def _stragglers(self, works: dict[int, float], records: dict[int, hp.Progress]) -> None:
        if len(records) < 2 or not works:
            return
        median = statistics.median(p.work_s for p in records.values() if p.steps > 0)
        if median <= 0:
            return
        for rank, work in works.items():
            if work > self.hang.straggler_ratio * median:
                self._slow[rank] = self._slow.get(rank, 0) + 1
                if self._slow[rank] == self.hang.straggler_iterations and rank not in self.stragglers:
                    rec = {"event": "straggler", "node": self.node, "rank": rank, "work_s": round(work, 4),
                           "node_median_work_s": round(median, 4), "iterations": self._slow[rank],
                           "time": time.time()}
                    self.stragglers[rank] = rec
                    log.warning("agent node %d: rank %d is a straggler: its own work %.3f s per iteration, %.1fx its "
                                "node's median, for %d iterations (reported, not ended)", self.node, rank, work,
                                work / median, self._slow[rank])
                    self._event(rec)
            else:
                self._slow[rank] = 0
                self.stragglers.pop(rank, None)

    def _event(self, rec: dict) -> None:
        if not self.events:
            return
        try:
            os.makedirs(os.path.dirname(self.events), exist_ok=True)
            with open(self.events, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
        except OSError as e:
            log.warning("agent node %d: could not record %s: %s", self.node, rec["event"], e)

    def status(self) -> dict:
        return {"hang_verdicts": list(self.verdicts), "stragglers": sorted(self.stragglers.values(),
                                                                           key=lambda r: r["rank"]),
                "iteration_p99_s": rule.p99(list(self.iter_times))}


def start_for(cfg, node: int, store) -> Optional[HangWatch]:
    """The agent's watch (``hang.enabled``), started: it creates - or re-opens, for an agent that adopts
    its predecessor's trainers - the node's progress file, which it owns from then on."""
    if not cfg.hang.enabled:
        return None
    board = hp.ProgressBoard.create(hp.board_path(cfg.agent.shm_dir, cfg.run_id, node), cfg.cluster.ranks_per_node)
    run_dir = os.environ.get("MFT_RUN_DIR")
    events = rank_files.node_path(os.path.join(run_dir, "events"), node, "agent.jsonl") if run_dir else None
    return HangWatch(cfg, node, board, store, events).start()
