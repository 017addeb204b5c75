"""Heartbeats and failure classification (GEMINI section 6: the root agent and the health store).

Every agent writes ``hb/<node>`` = ``{"pid", "seq", "time", "launcher", "addr", "trained"}`` every
``health.heartbeat_s`` (which also re-publishes its keys on a new root after a failover, see
:mod:`.store`). The root agent watches all of them: a heartbeat that has not changed for
``health.timeout_s`` (measured on the root's own monotonic clock, so clocks of different machines
never matter) is a *hardware* failure - the node's agent, and with it its memory, is gone - written
to ``failed/<node>`` for standby launchers and operators; a new heartbeat pid for that node clears it.
Sooner: once two heartbeats are missed, the root probes the agent's peer port (``addr``) with a TCP
connect, at most once per heartbeat period; *connection refused* means no process listens there any
more (the host answers, the agent is gone), which is the same verdict within a second. An accepted
connection (an agent alive but slow: the kernel accepts for a starved process too) or no answer (a
host that is down or unreachable sends nothing back) proves nothing, and ``timeout_s`` decides, so a
loaded machine gets no false verdict from the probe. The probes of k suspected nodes run at once
(:data:`PROBES_AT_ONCE` threads, each bounded by min(``heartbeat_s``, 0.5 s)); a beat waits for them at
most one such bound, and a probe still running is heard at a later beat, so unreachable hosts do not
delay the beat by k probes. The other agents follow the root's heartbeat.

Messages per heartbeat period (N nodes): each agent sets its ``hb/`` and reads the root's (2 requests,
whatever N); the root reads every heartbeat from its own map in process (the embedded store's
:class:`~megatron_ft.health.wire_store.LocalKV`: no request), so its server answers 2 (N - 1) requests
per period, 2 per node. This is the embedded store's monitor; on etcd, liveness is a lease per
agent and the root a lease-bound key (:class:`~megatron_ft.health.etcd_liveness.EtcdLiveness`, a
subclass sharing the verdict records and their withdrawal). ``launcher`` is the pid of the launcher that owns the
agent now, 0 while it has none (its launcher died and no new one adopted it yet): the launchers
read it to tell that the node hosting torchrun's rendezvous lost its launcher although its agent
lives (``megatron_ft.launch.Rendezvous``). A trainer that died
while its agent lives is a *software* failure: the agent reports it (``report_software``) and
recovery stays local.

    >>> classify(agent_alive=True, trainer_lost=True), classify(agent_alive=False, trainer_lost=True)
    ('software', 'hardware')
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Optional

from . import fencing

log = logging.getLogger("megatron_ft.health")

#: the root's probes of suspected nodes running at once (more wait for a free thread, heard at a later beat)
PROBES_AT_ONCE = 16

#: what the root (or the returning agent) writes into a verdict's claim key when the verdict is withdrawn:
#: no standby may claim that verdict's node after it
WITHDRAWN = fencing.WITHDRAWN


def claim_key(node: int, verdict: dict) -> str:
    """The key a standby claims verdict ``verdict`` on ``node`` with (compare-and-set from absent), and
    the root or the judged agent withdraws it with: one per verdict (its agent pid and time), so a
    withdrawn one never keeps a later verdict on the same agent from being claimed."""
    return f"claim/{node}/{verdict.get('pid')}/{verdict.get('time')}"


def stood_down_path(run_dir: str, node: int) -> str:
    """Where a stood-down agent leaves its word for its launcher (which then never starts it again)."""
    return os.path.join(run_dir, f"node{node}", "stood_down")


def classify(agent_alive: bool, trainer_lost: bool) -> Optional[str]:
    """Software failure: the node (its agent, its memory) lives; hardware: it does not."""
    if not agent_alive:
        return "hardware"
    return "software" if trainer_lost else None


def refuses_connections(address: str, timeout_s: float) -> bool:
    """True only when ``host:port`` answers a TCP connect with *refused* (nothing listens there);
    False when it accepts, times out or cannot be reached. Bounded by ``timeout_s``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False


class Monitor:
    """``launcher_pid``: called (no lock held) at every beat for the ``launcher`` field;
    ``address``: this agent's peer port (``host:port``), which the root probes when its heartbeats stop;
    ``trained``: called (no lock held) at every beat for the ``trained`` field - whether a trainer ever
    registered with this agent (a launcher tells a running job from one that is starting by it);
    ``clock``: our time, for heartbeat ages (a test drives it)."""

    def __init__(self, store: Any, node: int, nodes: int, heartbeat_s: float, timeout_s: float,
                 launcher_pid: Callable[[], int] = lambda: 0, address: str = "",
                 trained: Callable[[], bool] = lambda: False, clock: Callable[[], float] = time.monotonic,
                 fenced: Callable[[str], None] = lambda why: None, finished: Callable[[], bool] = lambda: False):
        self.store, self.node, self.nodes, self.clock = store, node, nodes, clock
        # this node's trainers all ended their training (the agent's hang watch reads it from the progress
        # records): the job is ending, agents stop one after another and a new root would judge the ones
        # gone first - no verdict then (see _judge)
        self.finished = finished
        self.fenced = fenced  # this agent was judged lost and its node claimed: it stands down (see beat)
        self.launcher_pid, self.address, self.trained = launcher_pid, address, trained
        self.heartbeat_s, self.timeout_s = heartbeat_s, timeout_s
        self.probe_after_s = min(2 * heartbeat_s, timeout_s)  # two heartbeats missed
        self._probed: dict[int, float] = {}  # node -> our time of its last probe (root)
        # node -> (its probe running, the heartbeat value it was started on) (root)
        self._probing: dict[int, tuple[concurrent.futures.Future, Optional[str]]] = {}
        self._probes: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self.seq = 0
        self.failed: dict[int, dict] = {}  # root's verdicts
        self._seen: dict[int, tuple[Optional[str], float]] = {}  # node -> (last heartbeat value, our time seen)
        self._looked: Optional[float] = None  # our time of the last look at the others' heartbeats
        self._pids: dict[int, int] = {}  # node -> agent pid whose verdict was last checked (root)
        self._judged_alive: set[int] = set()  # nodes judged failed by this root whose agent may yet resume
        self._resumed = False  # this monitor did not run for a while (an agent paused): look at its verdicts
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)

    def start(self) -> "Monitor":
        """Write the first heartbeat now, then one every ``heartbeat_s`` (a thread). Called before the
        agent serves anyone: an agent that dies at any moment after has a heartbeat the root can watch
        stop (a node whose heartbeat the root never saw could never be judged failed)."""
        self._beat_once()
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self._beat_once()

    def _beat_once(self) -> None:
        t0 = time.monotonic()
        try:
            self.beat()
        except Exception as e:  # the store may be failing over; try again next beat
            log.warning("node %d: heartbeat failed: %s", self.node, e)
        took = time.monotonic() - t0
        if took > max(1.0, 5 * self.heartbeat_s):  # a slow store (or probe) delays every verdict
            log.warning("node %d: one heartbeat took %.1f s (heartbeat_s %g)", self.node, took, self.heartbeat_s)

    def beat(self) -> None:
        """One heartbeat: write ours; the root watches everyone's, the others the root's."""
        self.seq += 1
        self.store.set(f"hb/{self.node}", json.dumps({"pid": os.getpid(), "seq": self.seq, "time": time.time(),
                                                         "launcher": self.launcher_pid(), "addr": self.address,
                                                         "trained": self.trained()}))
        if self.store.is_root:
            self._watch()
        else:
            self._watch_root()
        if self._resumed:
            self._resumed = False
            self._check_fenced()

    def _check_fenced(self) -> None:
        """After this agent did not run for a while (see :meth:`_look`): if the root judged it lost meanwhile
        and a standby claimed its node, this agent (its memory, its trainers) belongs to an old generation of
        the node and stands down (``fenced``); where nobody claimed it, the root withdraws the verdict
        (:meth:`_clear_verdict`) and the node trains on. Two store reads, only after such a pause."""
        try:
            verdict = json.loads(self.store.get(f"failed/{self.node}") or "{}")
            if verdict.get("pid") != os.getpid():
                return
            # the one decision the root and any standby race for: this agent withdraws the verdict itself
            # where nobody claimed it yet, or learns who did
            owner = self.store.compare_set(claim_key(self.node, verdict), "", f"{WITHDRAWN}node{self.node}")
        except Exception as e:
            log.warning("node %d: could not read the verdicts after a pause: %s", self.node, e)
            self._resumed = True  # again at the next beat
            return
        if owner and not owner.startswith(WITHDRAWN):
            self.fenced(f"node {self.node} was judged lost while this agent did not run ({verdict.get('why')}) and "
                        f"{owner} claimed it")

    def _look(self) -> float:
        """Now, on our clock, for a look at the others' heartbeats - and time this monitor did not run is
        not their silence. Its looks come every ``heartbeat_s`` (plus the beat's own store calls and
        probes); a gap beyond half of ``timeout_s`` means this process was not running (an overloaded
        host, a paused VM or process): heartbeats written meanwhile could not be read, so every node's
        last change moves forward by the excess, as if we had watched. A node that died meanwhile is
        judged at most that excess later; a gap shorter than that changes nothing (a slow store's
        delay stays in every verdict, as :meth:`_beat_once` warns)."""
        now = self.clock()
        last, self._looked = self._looked, now
        excess = now - last - self.timeout_s / 2 if last is not None else 0.0
        if excess > 0:
            self._resumed = True
            self._seen = {n: (v, t + excess) for n, (v, t) in self._seen.items()}
            log.warning("node %d: this agent did not run for %.1f s (an overloaded host, a stopped process): the "
                        "others' heartbeats are judged from now, not from then", self.node, now - last)
        return now

    def _observe(self, n: int, now: float) -> tuple[Optional[str], float, bool]:
        """Node ``n``'s heartbeat value, how long (on our clock) since it last changed, and
        whether it changed now (the first observation counts as a change). A heartbeat that
        vanished (the embedded store moved to a new root without it) is no news: the last value."""
        v = self.store.get(f"hb/{n}")
        last = self._seen.get(n)
        if v is None and last is not None and last[0] is not None:
            v = last[0]
        if last is None or last[0] != v:
            self._seen[n] = (v, now)
            return v, 0.0, True
        return v, now - last[1], False

    def _watch_root(self) -> None:
        """Not root: follow the root's heartbeat (so a new root knows the old one's last pid and
        when it stopped)."""
        root, now = self.store.root, self._look()
        if root < 0 or root == self.node:
            return
        self._observe(root, now)

    def _watch(self) -> None:
        """The root's look at every heartbeat (from its own map: no request): a change clears a verdict, a
        heartbeat unchanged past ``timeout_s`` is a verdict, one unchanged past two beats is probed (all
        such probes at once; the beat waits at most one probe's bound for them)."""
        now = self._look()
        due: dict[int, str] = {}  # node -> its agent's address, to probe now
        for n in range(self.nodes):
            if n == self.node:
                continue
            v, age, changed = self._observe(n, now)
            if v is None:
                continue
            beat = json.loads(v)
            pid = beat["pid"]
            if changed:
                self._clear_verdict(n, pid)
                continue
            if n in self.failed or age <= self.probe_after_s:
                continue
            if age > self.timeout_s:
                self._judge(n, pid, f"missed heartbeats for {age:.1f} s")
            elif beat.get("addr") and n not in self._probing and now - self._probed.get(n, float("-inf")) >= self.heartbeat_s:
                self._probed[n] = now
                due[n] = beat["addr"]
        if due or self._probing:
            self._probe(due, now)

    def _probe(self, due: dict[int, str], now: float) -> None:
        """Start the probes of ``due`` (node -> address), wait at most one probe's bound for every probe
        running, and judge each node whose agent's port refused while its heartbeat stayed unchanged."""
        bound = min(self.heartbeat_s, 0.5)
        if self._probes is None:
            self._probes = concurrent.futures.ThreadPoolExecutor(PROBES_AT_ONCE, thread_name_prefix="probe")
        for n, address in due.items():
            self._probing[n] = (self._probes.submit(refuses_connections, address, bound), self._seen[n][0])
        concurrent.futures.wait([f for f, _ in self._probing.values()], timeout=bound + 0.05)
        for n, (fut, value) in list(self._probing.items()):
            if not fut.done():
                continue  # heard at a later beat
            del self._probing[n]
            seen = self._seen.get(n)
            if not fut.result() or n in self.failed or seen is None or seen[0] != value or value is None:
                continue
            beat = json.loads(value)
            self._judge(n, beat["pid"], f"missed heartbeats for {now - seen[1]:.1f} s and its agent's port "
                                        f"{beat.get('addr')} refuses connections")

    def _judge(self, n: int, pid: int, why: str) -> None:
        """The root's verdict: node ``n``'s agent ``pid`` is lost (``why``), in ``failed/<n>`` and ``last_verdict``
        - unless this node's training is over (``finished``): at a job's end the agents stop one after
        another, and a root elected as the first of them stopped would judge those gone (a port that
        refuses is what a clean end looks like too); a node lost then costs nothing."""
        if self.finished():
            log.info("root: node %d %s, but this node's trainers ended their training: the job is ending, no "
                     "verdict", n, why)
            return
        verdict = {"node": n, "kind": classify(agent_alive=False, trainer_lost=True),
                   "pid": pid, "detected_by": self.node, "time": time.time(), "why": why}
        self.failed[n] = verdict
        self._judged_alive.add(n)  # its own next heartbeat, if any, comes from a paused agent
        self.store.set(f"failed/{n}", json.dumps(verdict))
        # changed by every verdict: a warm spare's keeper watches this one key (spares.fast_restart)
        self.store.set("last_verdict", f"{n}/{pid}/{verdict['time']}")
        log.error("root: node %d %s: hardware failure (agent and memory lost)", n, why)

    def _clear_verdict(self, n: int, pid: int) -> None:
        """A heartbeat of a node judged failed (by us or an earlier root): from a new agent pid (a
        replacement: the verdict goes), or from the judged agent itself, which did not run for a while (a
        paused process, an overloaded host). Then the verdict is withdrawn - the node trains on, nothing
        was lost - unless a standby claimed the node first: a tombstone in the claim's key (compare-and-set
        from absent) keeps any standby from claiming it after; a node claimed first stays failed and its
        returning agent stands down (:meth:`_check_fenced`)."""
        if n in self.failed:
            verdict = self.failed[n]
        elif self._pids.get(n) != pid or n in self._judged_alive:
            v = self.store.get(f"failed/{n}")
            verdict = json.loads(v) if v is not None else None
        else:
            return
        self._pids[n] = pid
        self._judged_alive.discard(n)
        if verdict is None:
            return
        if verdict["pid"] != pid:
            log.warning("root: node %d is back (a replacement agent, pid %s)", n, pid)
        else:
            owner = self.store.compare_set(claim_key(n, verdict), "", f"{WITHDRAWN}root{self.node}")
            if not owner.startswith(WITHDRAWN):
                log.error("root: node %d's agent (pid %s) runs again, but %s claimed the node: it stays failed "
                          "and that agent stands down", n, pid, owner)
                return
            log.warning("root: node %d's agent (pid %s) runs again after its failure verdict (it was paused or "
                        "starved, not lost), and no standby claimed the node: the verdict is withdrawn", n, pid)
        self.failed.pop(n, None)
        self.store.delete(f"failed/{n}")

    def report_software(self, rank: int) -> None:
        """A local trainer died while this agent lives: a software failure (local recovery)."""
        try:
            self.store.set(f"software/{self.node}", json.dumps({"rank": rank, "time": time.time(),
                                                               "kind": classify(True, True)}))
        except Exception as e:
            log.warning("node %d: could not report the software failure of rank %d: %s", self.node, rank, e)

    def stop(self) -> None:
        self._stop.set()
        if self._probes is not None:
            self._probes.shutdown(wait=False, cancel_futures=True)
